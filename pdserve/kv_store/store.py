"""`KVStore`: one worker's client of the shared KV store (read path, write path, metrics).

Read path: `lookup` (one round trip: how many of a request's next blocks the store holds or
another worker is writing), `should_fetch` (the break-even of `policy.FetchPolicy`), `fetch`
(read them into the blocks allocated for them, verifying each value, and waiting, at most
`pending_write_wait_s`, for those still being written). Write path: `write` copies full
computed blocks out of the cache into values and queues them on the write-behind thread,
which announces them to readers (in-flight markers) before it writes them.

Every failure is a miss: an unavailable store answers lookups with 0 and fetches with
nothing (errors counted by kind, then a backoff during which the store is not tried at all),
a rejected value ends the fetched run at that block (and is deleted, so a writer replaces
it). Nothing here raises to the caller for the store's sake.

Caches are passed as bytes: ``uint8 [num_layers * 2, num_blocks, one layer's K (or V) block
bytes]``, the form `cache_bytes` gives a ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`` array, so this package stays free of torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from pdserve.core.kv_events import KVCacheObserver
from pdserve.kv_store.backend import KVStoreBackend, Presence, create_backend
from pdserve.kv_store.codec import (
    check_value,
    head_nbytes,
    new_value,
    payload_view,
    seal,
    value_nbytes,
)
from pdserve.kv_store.config import KVStoreConfig
from pdserve.kv_store.errors import ErrorKind, StoreUnavailable, ValueRejected
from pdserve.kv_store.keys import BlockRef, KeyScheme, LayoutFingerprint
from pdserve.kv_store.metrics import KVStoreMetrics
from pdserve.kv_store.policy import FetchPolicy
from pdserve.kv_store.writer import PendingWrite, WriteBehind

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Bytes one fetch round trip asks for at most (pipelined GETs): far above a fast link's
# bandwidth-delay product (10 Gb/s x 1 ms is 1.25 MB), so the link stays busy, and a bound on
# what the server buffers for one reader and on what is read past a missing block.
MAX_FETCH_BYTES = 8 << 20
# Polls of a block another worker is writing: from the first interval, doubling up to the last.
_POLL_S, _MAX_POLL_S = 0.001, 0.016


def cache_bytes(cache: np.ndarray) -> np.ndarray:
    """A byte view ``[num_layers * 2, num_blocks, block bytes]`` of a contiguous cache array
    ``[num_layers, 2, num_blocks, ...]``."""
    num_layers, _, num_blocks = cache.shape[:3]
    return cache.view(np.uint8).reshape(num_layers * 2, num_blocks, -1)


class KVStore:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        config: KVStoreConfig,
        fingerprint: LayoutFingerprint,
        *,
        metrics: KVStoreMetrics | None = None,
        backend: KVStoreBackend | None = None,
    ) -> None:
        self.config = config
        self.keys = KeyScheme(fingerprint, config.namespace, config.namespace_secret)
        self.block_size = fingerprint.block_size
        self.payload_nbytes = fingerprint.payload_nbytes
        self.value_nbytes = value_nbytes(self.block_size, self.payload_nbytes)
        self._rows = 2 * fingerprint.num_layers
        self.metrics = metrics or KVStoreMetrics(fingerprint.model_id)
        self.policy = FetchPolicy()
        self._backoff = _Backoff(config.reconnect_backoff_s, config.max_reconnect_backoff_s)
        self.backend = backend or create_backend(config, self.keys.salt, self.value_nbytes)
        self._writer = WriteBehind(
            self._write_batch, int(config.write_queue_mb * 2**20), announce=self._announce
        )
        self._max_fetch_blocks = max(MAX_FETCH_BYTES // self.value_nbytes, 1)
        self._head_nbytes = head_nbytes(self.block_size)
        # Changes whenever blocks given to `write` may be missing from the store: an outage
        # began (it may come back empty) or queued writes were lost.
        self.epoch = 0
        # Told which blocks the store holds (writes landed), will hold (writes queued) and lacks
        # (a lookup or read missed them, a write failed): the worker's KV events of the store,
        # for routers.
        self.observer = KVCacheObserver()

    @property
    def is_available(self) -> bool:
        """False while backing off after a failure (every call is a miss until then)."""
        return self._backoff.is_ready()

    # ---- read path ---------------------------------------------------------------------
    def lookup(self, blocks: Sequence[BlockRef]) -> int:
        """How many of `blocks`, from the first on, the store holds or another worker is
        writing (`fetch` waits for those); one round trip."""
        if not blocks:
            return 0
        self.metrics.lookup_tokens.inc(len(blocks) * self.block_size)
        start = time.perf_counter()
        presence = self._call(self.backend.presence_many, self.keys.keys(blocks))
        if presence is None:
            return 0
        self.policy.observe_round_trip(time.perf_counter() - start)
        num_present = next(
            (i for i, p in enumerate(presence) if p is Presence.ABSENT), len(presence)
        )
        if num_present < len(blocks):
            self.observer.blocks_removed([blocks[num_present].block_hash])
        return num_present

    def should_fetch(self, num_blocks: int) -> bool:
        """Whether reading `num_blocks` beats recomputing their tokens (see `FetchPolicy`)."""
        return self.policy.should_fetch(
            num_blocks * self.block_size, num_blocks * self.value_nbytes
        )

    def fetch(self, blocks: Sequence[BlockRef], dest: np.ndarray, block_ids: Sequence[int]) -> int:
        """Read `blocks[i]` into cache block `block_ids[i]` of `dest` (see `cache_bytes`).

        Returns how many leading blocks arrived intact; from the first miss or rejected
        value on, blocks hold whatever the read left in them, for the caller to compute. A
        block another worker announced it is writing is waited for, as the writes land,
        until `pending_write_wait_s` after the start.

        Values are read straight into the blocks' rows of `dest` (C-contiguous), each head
        into a small buffer, and checked there (`codec.check_value`): no value is assembled.
        """
        start = time.perf_counter()
        deadline = time.monotonic() + self.config.pending_write_wait_s
        rows = _BlockRows(dest)
        num_read = num_bytes = 0
        waited_s = 0.0  # not the read's speed: kept out of the fetch policy's estimate
        rejected: list[bytes] = []
        try:
            while num_read < len(blocks):
                chunk = blocks[num_read : num_read + self._max_fetch_blocks]
                keys = self.keys.keys(chunk)
                heads = memoryview(bytearray(len(chunk) * self._head_nbytes))
                heads = [
                    heads[i * self._head_nbytes : (i + 1) * self._head_nbytes]
                    for i in range(len(chunk))
                ]
                parts = [
                    rows.of(block_id) for block_id in block_ids[num_read : num_read + len(chunk)]
                ]
                targets = [
                    [head, *block_rows] for head, block_rows in zip(heads, parts, strict=True)
                ]
                lengths = self._call(self.backend.read_into, keys, targets)
                if lengths is None:  # unavailable: a miss, counted by `_call`
                    break
                num_bytes += sum(n for n in lengths if n is not None)
                num_ok = self._check(chunk, lengths, heads, parts, keys, rejected)
                num_read += num_ok
                if num_ok == len(chunk):
                    continue
                if lengths[num_ok] is not None:  # rejected
                    break
                wait_start = time.perf_counter()
                has_landed = self._wait_landed(keys[num_ok], deadline)
                waited_s += time.perf_counter() - wait_start
                if not has_landed:
                    self.metrics.count_error(ErrorKind.EVICTED)
                    self.observer.blocks_removed([chunk[num_ok].block_hash])
                    break
        finally:
            seconds = time.perf_counter() - start
            self.metrics.read_bytes.inc(num_bytes)
            self.metrics.hit_tokens.inc(num_read * self.block_size)
            self.metrics.fetch_latency.observe(seconds)
            self.policy.observe_fetch(num_bytes, seconds - waited_s)
            if rejected:
                self._call(self.backend.delete_many, rejected)
        return num_read

    def _wait_landed(self, key: bytes, deadline: float) -> bool:
        """Whether the block at `key`, absent when read, is stored before `deadline`: polled
        while a writer's in-flight marker announces it."""
        poll_s = _POLL_S
        while True:
            presence = self._call(self.backend.presence_many, [key])
            if presence is None or presence[0] is Presence.ABSENT:
                return False
            if presence[0] is Presence.PRESENT:
                return True
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return False
            time.sleep(min(poll_s, remaining_s))
            poll_s = min(2 * poll_s, _MAX_POLL_S)

    def _check(
        self,
        blocks: Sequence[BlockRef],
        lengths: Sequence[int | None],
        heads: Sequence[memoryview],
        parts: Sequence[list[memoryview]],
        keys: Sequence[bytes],
        rejected: list[bytes],
    ) -> int:
        """The length of the leading run of values read intact (a rejected one is added to
        `rejected`; a missing one ends the run too)."""
        digest = self.keys.fingerprint_digest
        for i, length in enumerate(lengths):
            if length is None:  # the caller waits for it or counts the miss
                return i
            try:
                check_value(heads[i], length, parts[i], digest, blocks[i], self.payload_nbytes)
            except ValueRejected as exc:
                logger.info("KV store value rejected (%s): %s", exc.kind.value, exc)
                self.metrics.count_error(exc.kind)
                self.observer.blocks_removed([blocks[i].block_hash])
                rejected.append(keys[i])
                return i
        return len(lengths)

    # ---- write path --------------------------------------------------------------------
    def write(self, blocks: Sequence[BlockRef], src: np.ndarray, block_ids: Sequence[int]) -> int:
        """Copy `blocks[i]` out of cache block `block_ids[i]` of `src` (see `cache_bytes`) and
        queue it for writing. Never blocks; returns how many were queued (the others were
        dropped, and counted: queue full or store unavailable)."""
        if not self.is_available:
            self.metrics.dropped_writes.inc(len(blocks))
            return 0
        digest = self.keys.fingerprint_digest
        writes = []
        for block, block_id in zip(blocks, block_ids, strict=True):
            value = new_value(digest, block, self.payload_nbytes)
            payload = np.frombuffer(payload_view(value, self.block_size), np.uint8)
            payload.reshape(self._rows, -1)[:] = src[:, block_id]
            writes.append(PendingWrite(self.keys.key(block.block_hash), block.block_hash, value))
        num_queued = self._writer.submit(writes)
        self.metrics.dropped_writes.inc(len(blocks) - num_queued)
        self.observer.blocks_pending([w.block_hash for w in writes[:num_queued]])
        return num_queued

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write has been attempted (tests, shutdown)."""
        return self._writer.flush(timeout_s)

    def close(self, timeout_s: float = 1.0) -> None:
        """Write what is queued within `timeout_s` (the rest is dropped), then disconnect."""
        self.metrics.dropped_writes.inc(self._writer.close(timeout_s))
        self.backend.close()

    def _announce(self, writes: list[PendingWrite]) -> None:
        """On the write-behind thread, before writing: mark `writes` in flight, for readers."""
        self._call(
            self.backend.mark_pending,
            [w.key for w in writes],
            self.config.pending_write_wait_s,
            ok=True,
        )

    def _write_batch(self, batch: list[PendingWrite]) -> None:
        """On the write-behind thread: skip keys the store has, write the rest."""
        present = self._call(self.backend.exists_many, [w.key for w in batch])
        if present is None:
            self._lost(batch)
            return
        missing = [w for w, is_present in zip(batch, present, strict=True) if not is_present]
        if missing:
            items = [(w.key, seal(w.value)) for w in missing]
            if self._call(self.backend.put_many, items, ok=True) is None:
                self._lost(missing)
                return
            self.metrics.written_bytes.inc(sum(len(w.value) for w in missing))
        self.observer.blocks_stored([w.block_hash for w in batch])

    def _lost(self, writes: list[PendingWrite]) -> None:
        self.metrics.dropped_writes.inc(len(writes))
        self.epoch += 1
        self.observer.blocks_removed([w.block_hash for w in writes])  # announced as pending

    # ---- failures ----------------------------------------------------------------------
    def _call(self, operation: Callable[..., T], *args, ok: T | None = None) -> T | None:
        """`operation(*args)` (or `ok` when it returns None), or None when the store is
        unavailable: failures are counted, logged once per outage, and start a backoff."""
        if not self._backoff.is_ready():
            return None
        try:
            result = operation(*args)
        except StoreUnavailable as exc:
            self.metrics.count_error(exc.kind)
            # Only an unreachable or slow store is skipped for a while; one that answers
            # with an error (out of memory under noeviction, full) still serves reads.
            if exc.kind in (ErrorKind.CONNECTION, ErrorKind.TIMEOUT):
                delay = self._backoff.fail()
                if delay is not None:
                    self.epoch += 1
                    logger.warning(
                        "KV store unavailable (%s: %s); recomputing, retrying in %.1f s",
                        exc.kind.value,
                        exc,
                        delay,
                    )
            return None
        if self._backoff.succeed():
            logger.info("KV store %s is available again", self.config.redacted_url)
        return ok if result is None else result


class _BlockRows:
    """Each block's rows of a cache's bytes ``[rows, num_blocks, row bytes]`` (`cache_bytes`:
    one layer's K or V of the block per row), as views a read fills in the value's order."""

    def __init__(self, cache: np.ndarray) -> None:
        if not cache.flags.c_contiguous:
            raise ValueError("a KV store reads into a C-contiguous cache")
        self._flat = memoryview(cache.reshape(-1))
        self._num_rows, self._num_blocks, self._row_nbytes = cache.shape

    def of(self, block_id: int) -> list[memoryview]:
        n = self._row_nbytes
        stride = self._num_blocks * n
        first = block_id * n
        return [
            self._flat[first + r * stride : first + r * stride + n] for r in range(self._num_rows)
        ]


class _Backoff:
    """Exponential backoff after consecutive failures: `is_ready()` is False until the
    delay has passed. Thread-safe."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self._base_s = base_s
        self._max_s = max_s
        self._lock = threading.Lock()
        self._num_failures = 0
        self._retry_at = 0.0

    def is_ready(self) -> bool:
        return time.monotonic() >= self._retry_at

    def fail(self) -> float | None:
        """Record a failure; returns the delay if this one began an outage, else None."""
        with self._lock:
            self._num_failures += 1
            delay = min(self._base_s * 2 ** (self._num_failures - 1), self._max_s)
            self._retry_at = time.monotonic() + delay
            return delay if self._num_failures == 1 else None

    def succeed(self) -> bool:
        """Record a success; True if it ended an outage."""
        with self._lock:
            was_down = self._num_failures > 0
            self._num_failures = 0
            self._retry_at = 0.0
            return was_down
