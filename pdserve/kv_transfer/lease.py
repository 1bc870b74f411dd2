"""Sender-side leases: KV blocks handed out for a request stay allocated until the receiver
releases them or `lease_timeout` seconds pass, then go back to the engine.

Threads: `grant`/`collect` run on the engine thread; `reading`/`release` run on the KV
server's connection threads. A lease ends only inside `collect()`, which returns the ended
request ids to the engine thread, so the engine's (single-threaded) block manager is never
touched from another thread. An expired lease is refused at once, but it only ends at the next
`collect()`, and never while a sender-side read of its blocks is in flight.

A lease never comes back to life, and its blocks are reused only after it ends: so a
`release()` that finds the lease live proves every read made since `grant()` saw the leased
data. The shm receiver copies without asking first and relies on exactly that.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pdserve.kv_transfer.protocol import KVLeaseError

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # clock() value after which the lease is expired
    num_readers: int = 0  # sender-side reads in flight (tcp FETCH); pin the blocks
    is_released: bool = False


class LeaseManager:
    """Thread-safe registry of leased KV blocks with timeout."""

    def __init__(self, lease_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_timeout > 0:
            raise ValueError(f"kv_lease_timeout must be positive, got {lease_timeout!r}")
        self.lease_timeout = float(lease_timeout)
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Hold `block_ids` for `request_id`; the engine must not free them itself."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a KV lease")
            deadline = self._clock() + self.lease_timeout
            self._leases[request_id] = Lease(request_id, tuple(block_ids), deadline)

    @contextlib.contextmanager
    def reading(self, request_id: str) -> Iterator[Lease]:
        """Pin a live lease while the sender reads its blocks (not freed even if it expires)."""
        with self._lock:
            lease = self._live(request_id)
            lease.num_readers += 1
        try:
            yield lease
        finally:
            with self._lock:
                lease.num_readers -= 1

    def release(self, request_id: str, block_ids: Sequence[int] = ()) -> bool:
        """The receiver is done with the lease. True iff it was still live and `block_ids`
        (the blocks the receiver read) are all leased: every such read saw valid data."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.is_released:
                return False
            lease.is_released = True
            return self._clock() < lease.deadline and set(block_ids) <= set(lease.block_ids)

    def collect(self) -> list[str]:
        """End released and expired leases; returns their request ids, whose blocks the
        caller (the thread that owns the block manager) may now free."""
        now = self._clock()
        with self._lock:
            done = [
                lease
                for lease in self._leases.values()
                if (lease.is_released or now >= lease.deadline) and lease.num_readers == 0
            ]
            for lease in done:
                del self._leases[lease.request_id]
        for lease in done:
            if not lease.is_released:
                logger.warning(
                    "KV lease for request %r expired after %.1fs unfetched; freeing %d blocks",
                    lease.request_id,
                    self.lease_timeout,
                    len(lease.block_ids),
                )
        return [lease.request_id for lease in done]

    def close(self) -> None:
        """End every lease (shutdown; serve no more reads first)."""
        with self._lock:
            for lease in self._leases.values():
                lease.is_released = True
        self.collect()

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())

    def _live(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise KVLeaseError(f"no KV lease for request {request_id!r} (unknown or freed)")
        if lease.is_released:
            raise KVLeaseError(f"KV lease for request {request_id!r} was already released")
        if self._clock() >= lease.deadline:
            raise KVLeaseError(
                f"KV lease for request {request_id!r} expired "
                f"(kv_lease_timeout {self.lease_timeout:g}s)"
            )
        return lease
