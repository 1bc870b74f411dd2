"""Shared fixtures for the KV-transfer tests: a tiny layout, deterministic cache contents, and
a prefill-side process (spawned, so it is a real separate process) driven over a pipe."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import torch

from pdserve.kv_transfer import KVLayout, KVTransferConfig, KVTransferParams
from pdserve.kv_transfer.blocks import TORCH_DTYPES
from pdserve.kv_transfer.connector import create_kv_transport
from pdserve.kv_transfer.shm import SharedKVCache

NUM_BLOCKS = 64


def engine_cache(
    config: KVTransferConfig, layout: KVLayout, num_blocks: int
) -> torch.Tensor | SharedKVCache:
    """A cache as an engine's model runner allocates it for `config` (what connectors
    register): in shared memory for the shm transports."""
    if config.needs_shared_cache:
        return SharedKVCache.create(layout, num_blocks)
    return torch.zeros(layout.cache_shape(num_blocks), dtype=TORCH_DTYPES[layout.dtype])


def tiny_layout(dtype: str = "float32", **overrides) -> KVLayout:
    fields = {
        "model_id": "tiny-llama",
        "num_layers": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "block_size": 4,
        "dtype": dtype,
        **overrides,
    }
    return KVLayout(**fields)


def reference_cache(layout: KVLayout, num_blocks: int = NUM_BLOCKS, seed: int = 0) -> torch.Tensor:
    """The same pseudo-random cache contents in every process (CPU generator, fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layout.cache_shape(num_blocks), generator=generator)
    return values.to(TORCH_DTYPES[layout.dtype])


def count_parses(monkeypatch) -> list:
    """Every `KVTransferParams.from_dict` call from now on, by its input."""
    parse = KVTransferParams.from_dict.__func__
    parsed = []

    def counting_parse(cls, data, *args):
        parsed.append(data)
        return parse(cls, data, *args)

    monkeypatch.setattr(KVTransferParams, "from_dict", classmethod(counting_parse))
    return parsed


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so comparisons are bit-exact (and NaN-proof)."""
    return tensor.contiguous().view(torch.uint8)


@dataclass(frozen=True)
class SenderSpec:
    key: str
    transport: str
    dtype: str
    lease_timeout: float = 30.0


def run_sender(conn, specs: list[SenderSpec]) -> None:
    """Child process: one producer transport per spec, serving until told to stop."""
    torch.set_num_threads(1)
    transports = {}
    for spec in specs:
        layout = tiny_layout(spec.dtype)
        config = KVTransferConfig(
            transport=spec.transport, kv_role="kv_producer", kv_lease_timeout=spec.lease_timeout
        )
        transport = create_kv_transport(config, layout, NUM_BLOCKS)
        transport.kv_cache.copy_(reference_cache(layout))
        transports[spec.key] = transport
    conn.send("ready")
    while True:
        command, key, *args = conn.recv()
        if command == "stop":
            break
        transport = transports[key]
        if command == "expose":
            conn.send(transport.expose(*args).to_dict())
        elif command == "collect":
            conn.send(transport.collect())
        elif command == "num_held_blocks":
            conn.send(transport.leases.num_held_blocks)
    for transport in transports.values():
        transport.close()
    conn.send("stopped")


class SenderProcess:
    """Parent-side handle of `run_sender`."""

    def __init__(self, specs: list[SenderSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=run_sender, args=(child, specs), daemon=True)
        self._process.start()
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            raise RuntimeError("sender process did not start")

    def call(self, *command):
        self._conn.send(command)
        if not self._conn.poll(60):
            raise TimeoutError(f"sender process did not answer {command[0]}")
        return self._conn.recv()

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs in the sender."""
        self._process.kill()
        self._process.join(timeout=30)

    def stop(self) -> None:
        self.call("stop", None)
        self._process.join(timeout=30)
