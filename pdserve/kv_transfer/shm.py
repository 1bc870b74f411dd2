"""Same-host KV transfer through shared memory, no sockets on the data path.

`SharedKVCache`: a KV cache tensor in a /dev/shm file that other processes can map. The
prefill worker allocates its whole KV cache there, so a decode worker on the same host copies
leased blocks straight out of it into its own cache (`ShmTransport`): the bytes are copied
exactly once, with no staging on the sender and no round trip before the copy, and the
sender's CPU stays free for the next prompt. Validity is settled afterwards by RELEASE: the
producer answers `released: true` only if the lease was still live (see lease.py), which
proves the blocks were not reused while they were copied; otherwise `receive()` refuses.

Plain files rather than `multiprocessing.shared_memory`: on Python < 3.13 an attaching process
registers the segment with its resource tracker, which unlinks it when that process exits.
Names carry the owner's pid so `remove_stale_segments()` can clean up after a killed owner;
an owner that exits without `close()` (e.g. a server stopped by SIGTERM) unlinks its segments
at interpreter exit.

`AutoTransport` (``--kv-transport auto``, the cluster deployments') chooses per pair: its
cache lives in a segment like shm's, a receiver on the sender's node maps it, and receivers on
other nodes fetch the same blocks over tcp from the sender's KV server.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import mmap
import os
import re
import socket
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from pdserve.kv_transfer.blocks import TORCH_DTYPES, copy_blocks
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import (
    KVLayout,
    KVProtocolError,
    KVTransferError,
    KVTransferParams,
    KVTransferUnit,
)
from pdserve.kv_transfer.registry import offered_transports
from pdserve.kv_transfer.transport import KVTransport, RemoteEngine

SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^pdserve-kv-(\d+)-[0-9a-f]{12}$")
# Segments this process created and has not closed yet (unlinked at exit).
_owned_names: set[str] = set()


class SharedKVCache:
    """A ``[num_layers, 2, num_blocks, block_size, heads, dim]`` tensor backed by shared memory.

    `create` makes (and `close` unlinks) the segment; `attach` maps another process's segment.
    """

    def __init__(self, name: str, tensor: torch.Tensor, is_owner: bool) -> None:
        self.name = name
        self.tensor = tensor
        self.is_owner = is_owner

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[2]

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int) -> SharedKVCache:
        """Allocate a zeroed cache for this process (removing dead owners' segments first)."""
        remove_stale_segments()
        name = f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        nbytes = layout.nbytes(num_blocks)
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            tensor = _map(fd, nbytes, layout, num_blocks)
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        _owned_names.add(name)
        return cls(name, tensor, is_owner=True)

    @classmethod
    def attach(cls, name: str, layout: KVLayout) -> SharedKVCache:
        """Map a segment another process created; `name` comes off the wire, so it is checked
        against the naming pattern before it touches the filesystem."""
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise KVProtocolError(f"shm_name {name!r} is not a pdserve KV segment name")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY)
        except FileNotFoundError:
            raise KVTransferError(
                f"shared-memory KV segment {name} not found: the 'shm' transport needs both "
                "workers on one host (use 'tcp' across hosts), or the prefill worker exited"
            ) from None
        try:
            nbytes = os.fstat(fd).st_size
            per_block = layout.nbytes(1)
            if nbytes == 0 or nbytes % per_block:
                raise KVProtocolError(
                    f"shm segment {name} is {nbytes} bytes, not a whole "
                    f"number of {per_block}-byte blocks of {layout}"
                )
            tensor = _map(fd, nbytes, layout, nbytes // per_block, is_writable=False)
        finally:
            os.close(fd)
        return cls(name, tensor, is_owner=False)

    def close(self) -> None:
        """Owner: unlink the segment (mappings stay valid until their tensors are dropped)."""
        if self.is_owner:
            _unlink(self.name)


def _unlink(name: str) -> None:
    _owned_names.discard(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


@atexit.register
def _unlink_owned() -> None:
    for name in list(_owned_names):
        _unlink(name)


def _map(
    fd: int, nbytes: int, layout: KVLayout, num_blocks: int, is_writable: bool = True
) -> torch.Tensor:
    # MAP_POPULATE faults every page in now, so the first transfer is not slowed by page faults.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    # A reader maps read-only: a stray write faults instead of corrupting the owner's cache.
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if is_writable else 0)
    buffer = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        # frombuffer keeps `buffer` alive as long as the tensor is.
        flat = torch.frombuffer(buffer, dtype=TORCH_DTYPES[layout.dtype])
    return flat.view(layout.cache_shape(num_blocks))


def remove_stale_segments() -> list[str]:
    """Unlink segments whose owner process no longer exists; returns their names."""
    removed = []
    for path in SHM_DIR.glob("pdserve-kv-*"):
        match = _NAME_RE.match(path.name)
        if match and not _is_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class ShmTransport(KVTransport):
    """Shared-memory transport. A producer's `kv_cache` must be `segment.tensor`."""

    name: ClassVar[str] = "shm"

    def __init__(
        self,
        segment: SharedKVCache,
        layout: KVLayout,
        config: KVTransferConfig,
        leases: LeaseManager | None = None,
    ) -> None:
        self.segment = segment
        super().__init__(segment.tensor, layout, config, leases)

    def close(self) -> None:
        super().close()
        self.segment.close()

    def _hello_extra(self) -> dict[str, Any]:
        return {"shm_name": self.segment.name}

    def _params_extra(self) -> dict[str, Any]:
        return {"shm_name": self.segment.name}

    def _attach(self, remote: RemoteEngine, params: KVTransferParams) -> SharedKVCache:
        if remote.hello.get("shm_name") != params.shm_name:
            raise KVProtocolError(
                f"kv_transfer_params.shm_name {params.shm_name!r} is not the "
                f"segment of engine {remote.engine_id}"
            )
        mapped = SharedKVCache.attach(params.shm_name, remote.layout)
        if mapped.num_blocks != remote.num_blocks:
            raise KVProtocolError(
                f"shm segment {params.shm_name} holds {mapped.num_blocks} "
                f"blocks, the engine reports {remote.num_blocks}"
            )
        return mapped

    def _read_units(
        self, remote: RemoteEngine, request_id: str, units: Sequence[KVTransferUnit]
    ) -> int:
        if remote.attachment is None:  # a sender on another node (`AutoTransport`)
            return super()._read_units(remote, request_id, units)
        source = remote.attachment.tensor
        num_bytes = 0
        for unit in units:
            if max(unit.remote_block_ids) >= remote.num_blocks:
                raise KVProtocolError(
                    f"unit.remote_block_ids exceed the {remote.num_blocks} "
                    f"blocks of engine {remote.engine_id}"
                )
            layers = slice(unit.layer_start, unit.layer_end)
            copy_blocks(
                self.kv_cache[layers], unit.local_block_ids, source[layers], unit.remote_block_ids
            )
            num_bytes += self.layout.nbytes(unit.num_blocks, unit.num_layers)
        return num_bytes


class AutoTransport(ShmTransport):
    """Chosen per pair: a sender's blocks are copied out of its shared segment when it runs on
    this worker's node (the same `kv_node_id` in its HELLO), fetched over tcp otherwise. A
    sender offers ``transport: "shm"`` (its segment, and its KV server for everyone else); a
    receiver accepts both offers."""

    name: ClassVar[str] = "auto"

    @property
    def node_id(self) -> str:
        return self.config.kv_node_id or host_node_id()

    def _hello_extra(self) -> dict[str, Any]:
        return {**super()._hello_extra(), "node_id": self.node_id}

    def _params_extra(self) -> dict[str, Any]:
        return {**super()._params_extra(), "transport": ShmTransport.name}

    def _accepts(self, transport: str) -> bool:
        return transport in offered_transports()

    def _attach(self, remote: RemoteEngine, params: KVTransferParams) -> SharedKVCache | None:
        if params.transport != ShmTransport.name or remote.hello.get("node_id") != self.node_id:
            return None
        return super()._attach(remote, params)


@functools.cache
def host_node_id() -> str:
    """This host as a node: its name and boot (two hosts, or two boots, never share
    /dev/shm)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"
