"""The write-behind path: a bounded queue of block values and one thread that writes them.

`submit` never blocks and never fails: past `max_bytes` queued it drops the writes (the
caller counts it), so a slow or full store costs the engine nothing but the copy it already
made. The thread first hands every write queued since its last turn to `announce` (the store
marks them in flight, so a reader waits for them rather than computing them: this is one round
trip, ahead of the batch), then takes whatever is queued, up to `max_batch` values, and hands
the batch to `write_batch` (which skips keys the store already has and writes the rest in one
round trip).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingWrite:
    key: bytes
    block_hash: int  # the chained hash the key is salted from (what KV events name)
    # A complete value but for its checksum, which the write thread seals (codec.seal).
    value: bytearray


class WriteBehind:
    def __init__(
        self,
        write_batch: Callable[[list[PendingWrite]], None],
        max_bytes: int,
        max_batch: int = 32,
        announce: Callable[[list[PendingWrite]], None] | None = None,
    ) -> None:
        self._write_batch = write_batch
        self._announce = announce
        self.max_bytes = max_bytes
        self._max_batch = max_batch
        self._queue: deque[PendingWrite] = deque()
        self._unannounced: list[PendingWrite] = []  # queued since the thread's last turn
        self._cond = threading.Condition()
        self._queued_bytes = 0  # queued plus in flight
        self._num_in_flight = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="pdserve-kv-store-writer", daemon=True
        )
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def submit(self, writes: list[PendingWrite]) -> int:
        """Queue the leading `writes` that fit, together (the thread announces them in one
        turn); returns how many (the rest are dropped: the queue is full or closed)."""
        with self._cond:
            num_queued = 0
            for write in writes:
                if self._closed or self._queued_bytes + len(write.value) > self.max_bytes:
                    break
                self._queue.append(write)
                self._unannounced.append(write)
                self._queued_bytes += len(write.value)
                num_queued += 1
            if num_queued:
                self._cond.notify()
        return num_queued

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write has been attempted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._num_in_flight, timeout_s
            )

    def close(self, timeout_s: float = 1.0) -> int:
        """Write what is queued within `timeout_s`, then stop; returns the writes dropped."""
        self.flush(timeout_s)
        with self._cond:
            num_dropped = len(self._queue)
            self._queue.clear()
            self._unannounced.clear()
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return num_dropped

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch = [
                    self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))
                ]
                self._num_in_flight = len(batch)
                fresh, self._unannounced = self._unannounced, []
            try:
                if fresh and self._announce is not None:
                    self._announce(fresh)
                self._write_batch(batch)
            except Exception:  # a bug must not kill the thread and stall every later write
                logger.exception("KV store write-behind batch failed")
            with self._cond:
                self._queued_bytes -= sum(len(w.value) for w in batch)
                self._num_in_flight = 0
                self._cond.notify_all()
