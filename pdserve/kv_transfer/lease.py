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

A streamed lease (`open_stream`) starts empty while its request still computes: the engine
`publish`es each step's newly full prompt blocks, and `close_stream` adds the rest (the last,
partial block) and the first token when the request finishes. While open the blocks are the
running request's, so the lease never ends then (`collect` skips it); its timeout runs from
`close_stream`. `watch` is the receiver's wait for what is new; a watch answered while the
lease is intact also proves every read made before it (the same argument as `release`).
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
    # A streamed lease whose request still computes (its blocks grow, `publish`).
    is_open: bool = False
    first_token_id: int | None = None
    closed_at: float | None = None  # clock() at `close_stream`


@dataclass(frozen=True)
class StreamState:
    """A streamed lease as a `watch` found it: `block_ids` from the watcher's `num_known`
    on, whether the request finished (then its first token, and how long ago)."""

    block_ids: tuple[int, ...]
    is_complete: bool
    first_token_id: int | None
    complete_age_s: float


class LeaseManager:
    """Thread-safe registry of leased KV blocks with timeout."""

    def __init__(self, lease_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_timeout > 0:
            raise ValueError(f"kv_lease_timeout must be positive, got {lease_timeout!r}")
        self.lease_timeout = float(lease_timeout)
        self._clock = clock
        self._lock = threading.Lock()
        # Notified whenever a streamed lease grows, closes or ends (`watch` waits on it).
        self._changed = threading.Condition(self._lock)
        self._leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Hold `block_ids` for `request_id`; the engine must not free them itself."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a KV lease")
            deadline = self._clock() + self.lease_timeout
            self._leases[request_id] = Lease(request_id, tuple(block_ids), deadline)

    def open_stream(self, request_id: str) -> None:
        """Start an empty streamed lease for a request about to compute."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a KV lease")
            self._leases[request_id] = Lease(request_id, (), float("inf"), is_open=True)

    def publish(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Append blocks whose KV is final (full prompt blocks a step completed)."""
        with self._changed:
            lease = self._leases.get(request_id)
            if lease is not None and lease.is_open:
                lease.block_ids += tuple(block_ids)
                self._changed.notify_all()

    def close_stream(
        self, request_id: str, block_ids: Sequence[int], first_token_id: int | None
    ) -> None:
        """The request finished: `block_ids` are all its prompt's blocks; the timeout starts."""
        with self._changed:
            lease = self._leases.get(request_id)
            if lease is None or not lease.is_open:
                return
            lease.block_ids = tuple(block_ids)
            lease.first_token_id = first_token_id
            lease.closed_at = self._clock()
            lease.deadline = lease.closed_at + self.lease_timeout
            lease.is_open = False
            self._changed.notify_all()

    def abandon(self, request_id: str) -> None:
        """The streamed request ended without its KV (aborted, preempted): the lease ends at
        the next `collect`, a watcher hears of it at once."""
        with self._changed:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.is_open = False
                lease.is_released = True
                self._changed.notify_all()

    def watch(self, request_id: str, num_known: int, timeout: float) -> StreamState:
        """Wait up to `timeout` for a streamed lease to have more than `num_known` blocks or
        to close; raises `KVLeaseError` once it ended (released, abandoned, expired)."""
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    (lease := self._leases.get(request_id)) is None
                    or lease.is_released
                    or not lease.is_open
                    or len(lease.block_ids) > num_known
                ),
                timeout,
            )
            lease = self._live(request_id)
            is_complete = not lease.is_open
            return StreamState(
                lease.block_ids[num_known:],
                is_complete,
                lease.first_token_id,
                self._clock() - lease.closed_at if is_complete else 0.0,
            )

    def is_open(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is not None and lease.is_open

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
            self._changed.notify_all()
            return self._clock() < lease.deadline and set(block_ids) <= set(lease.block_ids)

    def collect(self) -> list[str]:
        """End released and expired leases; returns their request ids, whose blocks the
        caller (the thread that owns the block manager) may now free."""
        now = self._clock()
        with self._lock:
            done = [
                lease
                for lease in self._leases.values()
                if (lease.is_released or now >= lease.deadline)
                and lease.num_readers == 0
                and not lease.is_open
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
        with self._changed:
            for lease in self._leases.values():
                lease.is_released = True
                lease.is_open = False
            self._changed.notify_all()
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
