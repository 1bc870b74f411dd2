"""A real `redis-server` per test on a free loopback port, tiny layouts and their blocks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from pdserve.core.block_manager import extend_block_hashes
from pdserve.kv_store import BlockRef, KVStore, KVStoreConfig, LayoutFingerprint, block_refs
from pdserve.kv_store.store import cache_bytes
from tests.router.harness import free_port, wait_until

REDIS_SERVER = shutil.which("redis-server")
TINY = LayoutFingerprint(
    model_id="tiny-test-model",
    dtype="float32",
    kv_dtype="float32",
    quantization=None,
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
NUM_CACHE_BLOCKS = 64


class RedisServer:
    """`redis-server` on 127.0.0.1:`port`, no persistence: a restart comes back empty."""

    def __init__(self, work_dir: Path, *extra_args: str) -> None:
        self.port = free_port()
        self.work_dir = work_dir
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self._clients: list[redis.Redis] = []
        self.start()

    def client(self, **options) -> redis.Redis:
        """A plain redis-py client, to plant values and read server stats."""
        client = redis.Redis(port=self.port, **options)
        self._clients.append(client)
        return client

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.work_dir)]
        command += ["--enable-debug-command", "local"]  # DEBUG SLEEP: a slow server
        log = open(self.work_dir / f"redis-{self.port}.log", "ab")  # noqa: SIM115
        self.process = subprocess.Popen([*command, *self.extra_args], stdout=log, stderr=log)
        log.close()
        wait_until(self._is_up, timeout=10.0, what="redis-server to answer PING")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def _is_up(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (make install-test installs it)")
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def make_store() -> Iterator:
    """Build `KVStore`s that are closed after the test."""
    stores: list[KVStore] = []

    def make(url: str, fingerprint: LayoutFingerprint = TINY, **config) -> KVStore:
        options = {"reconnect_backoff_s": 0.05, "max_reconnect_backoff_s": 0.2, **config}
        store = KVStore(KVStoreConfig(url, **options), fingerprint)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@dataclass
class Sequence:
    """A token sequence, its full blocks and a cache holding their KV."""

    token_ids: list[int]
    blocks: list[BlockRef]
    cache: np.ndarray  # [num_layers, 2, NUM_CACHE_BLOCKS, block_size, heads, dim]
    block_ids: list[int]

    @property
    def cache_bytes(self) -> np.ndarray:
        return cache_bytes(self.cache)


def make_sequence(
    num_blocks: int, seed: int = 0, fingerprint: LayoutFingerprint = TINY, first_token: int = 0
) -> Sequence:
    """`num_blocks` full blocks of tokens in random cache blocks filled with random KV."""
    rng = np.random.default_rng(seed)
    size = fingerprint.block_size
    token_ids = [first_token, *rng.integers(0, 50_000, num_blocks * size - 1).tolist()]
    hashes = extend_block_hashes([], token_ids, size)
    shape = (fingerprint.num_layers, 2, NUM_CACHE_BLOCKS, size)
    cache = rng.standard_normal((*shape, fingerprint.num_kv_heads, fingerprint.head_dim))
    cache = cache.astype(fingerprint.kv_dtype)
    block_ids = rng.choice(NUM_CACHE_BLOCKS, num_blocks, replace=False).tolist()
    return Sequence(token_ids, block_refs(hashes, token_ids, size, 0, num_blocks), cache, block_ids)


def empty_cache(fingerprint: LayoutFingerprint = TINY) -> np.ndarray:
    shape = (fingerprint.num_layers, 2, NUM_CACHE_BLOCKS, fingerprint.block_size)
    return np.zeros((*shape, fingerprint.num_kv_heads, fingerprint.head_dim), fingerprint.kv_dtype)


def blocks_equal(a: np.ndarray, a_ids: list[int], b: np.ndarray, b_ids: list[int]) -> bool:
    return np.array_equal(a[:, :, a_ids], b[:, :, b_ids])


def sleep_past_backoff(store: KVStore) -> None:
    time.sleep(store.config.max_reconnect_backoff_s + 0.05)
