"""KV events: what a worker's prefix cache holds, published in order so routers can index it.

The `BlockManager` tells its `cache_observer` each time full blocks enter the prefix cache
(`blocks_stored`) and each time cached content leaves it (`blocks_removed`: evicted for a
fresh block). `KVEventLog` is that observer on a worker: it numbers every change (`seq`, one
per event, from 1 within an `epoch`, a random id per process), keeps the last
`max_events` for subscribers that fall behind a little, and mirrors the cached set so a
subscriber that fell behind further (or just connected, or saw a gap) gets a `Snapshot`
consistent with a sequence number. A restart is a new epoch: a subscriber asking to resume
an old one gets a snapshot. Thread-safe: the engine thread appends, HTTP handlers read.

Events carry the chained block hashes of `core.block_manager` (the same every process
computes from the same tokens), so a router matches a prompt against them directly. A worker
with a shared KV store also reports, on the same log, what it learned the store holds
(`Medium.STORE`: it queued writes, which readers wait for (`pending`); its writes landed
(`stored`); a write failed, or a lookup or read found a block gone (`removed`)).
"""

from __future__ import annotations

import enum
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

BlockHash = int


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    # Store only: queued for writing (a reader waits for it); `stored` or `removed` follows.
    PENDING = "pending"


class Medium(enum.Enum):
    DEVICE = "device"  # the worker's own KV cache
    STORE = "store"  # the shared KV store, as this worker saw it


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...]
    medium: Medium = Medium.DEVICE

    def to_dict(self) -> dict:
        record = {"type": self.kind.value, "seq": self.seq, "block_hashes": list(self.block_hashes)}
        if self.medium is not Medium.DEVICE:
            record["medium"] = self.medium.value
        return record


@dataclass(frozen=True)
class Snapshot:
    """Every hash cached (and known in the store, or being written to it) once the events up
    to `seq` (of `epoch`) are applied."""

    epoch: str
    seq: int
    block_hashes: tuple[BlockHash, ...]
    store_block_hashes: tuple[BlockHash, ...] = ()

    def to_dict(self) -> dict:
        return {
            "type": "snapshot",
            "epoch": self.epoch,
            "seq": self.seq,
            "block_hashes": list(self.block_hashes),
            "store_block_hashes": list(self.store_block_hashes),
        }


class KVCacheObserver:
    """What a `BlockManager` reports; the base ignores everything."""

    def blocks_stored(self, block_hashes: list[BlockHash]) -> None:
        """These hashes entered the prefix cache (each was not cached before)."""

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        """These hashes left the prefix cache (their blocks were reused)."""

    def blocks_pending(self, block_hashes: list[BlockHash]) -> None:
        """(A KV store's observer only) these hashes are queued for writing to the store."""


class KVEventLog(KVCacheObserver):
    """A worker's numbered KV events (see module docstring)."""

    def __init__(self, max_events: int = 4096) -> None:
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._seq = 0
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._cached: dict[Medium, set[BlockHash]] = {medium: set() for medium in Medium}
        # Called (on the appending thread, outside the lock) after every new event.
        self._listeners: list[Callable[[], None]] = []

    @property
    def seq(self) -> int:
        return self._seq

    def blocks_stored(self, block_hashes: list[BlockHash]) -> None:
        self._append(KVEventKind.STORED, block_hashes)

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        self._append(KVEventKind.REMOVED, block_hashes)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(
                self.epoch,
                self._seq,
                tuple(self._cached[Medium.DEVICE]),
                tuple(self._cached[Medium.STORE]),
            )

    def store_observer(self) -> KVCacheObserver:
        """The observer a worker's KV store reports to (events of `Medium.STORE`)."""
        return _StoreEvents(self)

    def events_after(self, epoch: str, seq: int) -> list[KVEvent] | None:
        """The events after `seq` of `epoch`, oldest first; None when they cannot be replayed
        (another epoch, or some were dropped from the log): the reader needs a snapshot."""
        with self._lock:
            if epoch != self.epoch or seq > self._seq:
                return None
            if seq == self._seq:
                return []
            oldest = self._events[0].seq if self._events else self._seq + 1
            if seq + 1 < oldest:
                return None
            return list(self._events)[seq + 1 - oldest :]

    def add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _append(
        self, kind: KVEventKind, block_hashes: Iterable[BlockHash], medium: Medium = Medium.DEVICE
    ) -> None:
        hashes = tuple(block_hashes)
        if not hashes:
            return
        with self._lock:
            self._seq += 1
            self._events.append(KVEvent(self._seq, kind, hashes, medium))
            if kind is not KVEventKind.REMOVED:
                self._cached[medium].update(hashes)
            else:
                self._cached[medium].difference_update(hashes)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


class _StoreEvents(KVCacheObserver):
    def __init__(self, log: KVEventLog) -> None:
        self._log = log

    def blocks_stored(self, block_hashes: list[BlockHash]) -> None:
        self._log._append(KVEventKind.STORED, block_hashes, Medium.STORE)

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        self._log._append(KVEventKind.REMOVED, block_hashes, Medium.STORE)

    def blocks_pending(self, block_hashes: list[BlockHash]) -> None:
        self._log._append(KVEventKind.PENDING, block_hashes, Medium.STORE)
