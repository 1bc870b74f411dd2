"""`BackgroundReceiver`: run KV fetches off the engine thread; the engine polls for results.

The decode engine allocates local blocks for a request in `waiting_for_remote_kv`, submits the
transfer here and keeps stepping other requests; each step it calls `poll()` and schedules the
requests whose KV arrived (or applies its failure policy to those that failed). Writes go
only to the submitted blocks, which the engine does not touch until the transfer is polled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.protocol import KVTransferParams
from pdserve.kv_transfer.transport import KVTransport, TransferStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedTransfer:
    """Outcome of one submitted transfer: `stats` on success, else `error`."""

    request_id: str
    stats: TransferStats | None
    error: BaseException | None

    @property
    def is_ok(self) -> bool:
        return self.error is None


class BackgroundReceiver:
    """A small thread pool around `KVTransport.receive`."""

    def __init__(self, transport: KVTransport, max_workers: int = 1) -> None:
        self._transport = transport
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-recv")
        self._lock = threading.Lock()
        self._finished: list[FinishedTransfer] = []

    def submit(
        self,
        request_id: str,
        params: KVTransferParams,
        local_block_ids: Sequence[int],
        skip_blocks: int = 0,
    ) -> None:
        """Start fetching `params`' blocks into `local_block_ids` (see `KVTransport.receive`)."""
        future = self._pool.submit(
            self._transport.receive, params, tuple(local_block_ids), skip_blocks=skip_blocks
        )
        future.add_done_callback(lambda f: self._done(request_id, f))

    def submit_release(self, params: KVTransferParams) -> None:
        """Release a lease without fetching (the data is not needed), off the engine thread.
        A failure is only logged: the sender's lease timeout frees the blocks anyway."""
        self._pool.submit(self._release_quietly, params)

    def poll(self) -> list[FinishedTransfer]:
        """Transfers finished since the last poll."""
        with self._lock:
            finished, self._finished = self._finished, []
            return finished

    def close(self) -> None:
        """Wait for running transfers (bounded by the transfer timeout) and stop the pool."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _release_quietly(self, params: KVTransferParams) -> None:
        try:
            self._transport.release(params)
        except KVTransferError as exc:
            logger.info("could not release KV lease %r: %s", params.remote_request_id, exc)

    def _done(self, request_id: str, future: Future) -> None:
        if future.cancelled():
            error: BaseException | None = RuntimeError("KV transfer cancelled at shutdown")
        else:
            error = future.exception()
        stats = future.result() if error is None else None
        with self._lock:
            self._finished.append(FinishedTransfer(request_id, stats, error))
