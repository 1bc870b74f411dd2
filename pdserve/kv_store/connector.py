"""`KVStoreConnector`: the shared store as a KV connector (`core.kv_connector`).

Read path, at admission, after the local prefix cache: `get_num_new_matched_tokens` looks up
the request's next blocks (one round trip, remembered per request so the scheduler's
repeated asks cost nothing and get the same answer; blocks another worker is still writing
count, and the read waits for them) and claims them when fetching beats
recomputing (`FetchPolicy`); `update_state_after_alloc` starts reading them into the
request's freshly allocated blocks on a background thread while the request waits in
`WAITING_FOR_REMOTE_KV`; `get_finished` reports it received, with `num_external_tokens`
cut to the leading run of blocks that arrived intact: a missing or rejected value (or an
unreachable store) means the rest, or all of it, is computed in the blocks the request
already holds. A store read never fails a request (`failed_recving` stays empty).

Write path: `save_computed_blocks`, after each step and as a request ends, copies the
prompt's newly full blocks into the store's write-behind queue, skipping those known to be in
the store (read from it or written before). Blocks served by the local
prefix cache are written too unless known, so a store that came back empty after an outage
is refilled by the prefixes every worker still holds.

Threading: every method runs on the engine thread; fetches run on one background thread and
write only into the blocks they were given, which the scheduler does not touch until
`get_finished` reports them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pdserve.core.block_manager import extend_block_hashes
from pdserve.core.kv_connector import KVConnectorBase, KVOutcome, KVStoreOutcome, KVTransferEvents
from pdserve.core.request import Request, SchedulerOutput
from pdserve.kv_store.keys import BlockRef, block_refs
from pdserve.kv_store.store import KVStore, cache_bytes

logger = logging.getLogger(__name__)
# Block hashes remembered as stored: 64k blocks are a million tokens at block size 16.
MAX_KNOWN_BLOCKS = 1 << 16


@dataclass(frozen=True)
class StoreFetch:
    """One request's read from the store: what was asked, what arrived, how long it took."""

    num_blocks: int  # claimed at lookup
    num_read: int  # arrived intact (the leading run)
    seconds: float


@dataclass(frozen=True)
class _Found:
    """A remembered lookup: blocks `[start, start + len(blocks))` are in the store."""

    start: int
    blocks: list[BlockRef]
    is_worth_fetching: bool


class KVStoreConnector(KVConnectorBase):
    """See the module docstring. `cache` is the engine's KV cache as bytes
    (`store.cache_bytes`; or registered later, `register_kv_caches`): fetched blocks are
    written into it, saved blocks read from it."""

    def __init__(self, store: KVStore, cache: np.ndarray | None = None) -> None:
        self.store = store
        self.cache = cache
        self.block_size = store.block_size
        self._found: dict[str, _Found] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-store-fetch")
        self._lock = threading.Lock()
        self._done: list[tuple[str, StoreFetch]] = []
        self._fetching: dict[str, tuple[Request, list[BlockRef]]] = {}
        self._abandoned: set[str] = set()
        # Per running request: its prompt's full blocks before this index are in the store,
        # the local prefix cache, or the write queue.
        self._num_saved: dict[str, int] = {}
        # Block hashes known to be in the store (found, or queued for writing), most recent
        # last; forgotten when the store's epoch changes (an outage, lost writes).
        self._known: OrderedDict[int, None] = OrderedDict()
        self._known_epoch = 0
        self._results: dict[str, StoreFetch] = {}
        # Requests whose read is over (whatever it brought), until their admission to compute
        # the rest: they are not looked up again meanwhile.
        self._settled: set[str] = set()

    @property
    def recompute_on_failure(self) -> bool:
        return True

    def register_kv_caches(self, kv_cache) -> None:
        import torch  # only here: the package itself stays torch-free (store.py)

        tensor = getattr(kv_cache, "tensor", kv_cache)  # a shared segment holds its tensor
        if tensor.device.type != "cpu":
            # Reading and writing a GPU cache would need host staging buffers: not built yet.
            raise ValueError("--kv-store needs the KV cache in CPU memory (--device cpu)")
        self.cache = cache_bytes(tensor.view(torch.uint8).numpy())

    def metrics_collectors(self) -> list:
        return [self.store.metrics]

    # ---- read path ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        start = num_computed_tokens // self.block_size
        # Leave at least one token to compute, so the request can sample.
        stop = (request.num_tokens - 1) // self.block_size
        if request.request_id in self._settled or stop <= start:
            return 0
        found = self._found.get(request.request_id)
        if found is None or found.start != start:
            found = self._lookup(request, start, stop)
            self._found[request.request_id] = found
        return len(found.blocks) * self.block_size if found.is_worth_fetching else 0

    def _lookup(self, request: Request, start: int, stop: int) -> _Found:
        hashes = self._hashes(request)
        blocks = block_refs(hashes, request.all_token_ids, self.block_size, start, stop)
        # Counts blocks still being written; they are remembered once they arrive.
        num_found = self.store.lookup(blocks)
        return _Found(
            start, blocks[:num_found], num_found > 0 and self.store.should_fetch(num_found)
        )

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        request_id = request.request_id
        found = self._found.pop(request_id, None)
        if num_external_tokens == 0:
            # Computed here from its current position on: save what it computes. (After a
            # preemption it may read the store again.)
            self._settled.discard(request_id)
            self._num_saved[request_id] = 0
            return
        num_blocks = num_external_tokens // self.block_size
        block_ids = request.block_table[found.start : found.start + num_blocks]
        blocks = found.blocks[:num_blocks]
        self._fetching[request_id] = (request, blocks)
        future = self._pool.submit(self._fetch, blocks, block_ids)
        future.add_done_callback(lambda f: self._fetched(request_id, num_blocks, f))

    def _fetch(self, blocks: list[BlockRef], block_ids: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        num_read = self.store.fetch(blocks, self.cache, block_ids)
        return num_read, time.perf_counter() - start

    def _fetched(self, request_id: str, num_blocks: int, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():  # KVStore.fetch turns store failures into misses
                logger.error("KV store fetch crashed", exc_info=future.exception())
            result = StoreFetch(num_blocks, 0, 0.0)
        else:
            num_read, seconds = future.result()
            result = StoreFetch(num_blocks, num_read, seconds)
        with self._lock:
            self._done.append((request_id, result))

    def get_finished(self) -> KVTransferEvents:
        events = KVTransferEvents()
        with self._lock:
            done, self._done = self._done, []
        for request_id, result in done:
            request, blocks = self._fetching.pop(request_id)
            self._remember(b.block_hash for b in blocks[: result.num_read])
            if request_id in self._abandoned:
                self._abandoned.discard(request_id)
                events.finished_recving.add(request_id)  # frees its held blocks
                continue
            self._results[request_id] = result
            self._settled.add(request_id)
            # Only the leading run that arrived intact counts; the request computes the
            # rest in the blocks it holds (all of them if nothing arrived).
            request.num_external_tokens = result.num_read * self.block_size
            events.finished_recving.add(request_id)
        return events

    def take_result(self, request_id: str) -> KVOutcome:
        """How the request's store read went, once; for its timing breakdown."""
        fetch = self._results.pop(request_id, None)
        if fetch is None:
            return KVOutcome()
        return KVOutcome(store=KVStoreOutcome(fetch.num_read * self.block_size, fetch.seconds))

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        request_id = request.request_id
        self.save_computed_blocks(request)  # its blocks are still allocated
        self._found.pop(request_id, None)
        self._num_saved.pop(request_id, None)
        self._results.pop(request_id, None)
        self._settled.discard(request_id)
        if request_id in self._fetching:
            self._abandoned.add(request_id)
            return True, None  # the fetch still writes into its blocks
        return False, None

    # ---- write path --------------------------------------------------------------------
    def save_after_step(self, output: SchedulerOutput, step_seconds: float) -> None:
        """Write the prompt blocks this step completed; time the step's prompt tokens (the
        store's fetch-or-recompute break-even)."""
        num_prefill = sum(
            s.num_new_tokens
            for s in output.scheduled
            if s.request.num_computed_tokens - s.num_new_tokens < s.request.num_prompt_tokens
        )
        self.store.policy.observe_prefill(num_prefill, step_seconds)
        for scheduled in output.scheduled:
            if not scheduled.request.is_finished:  # finished ones were saved as they ended
                self.save_computed_blocks(scheduled.request)

    def save_computed_blocks(self, request: Request) -> int:
        """Queue the prompt's full blocks completed since the last call that the store is not
        known to hold; returns how many were queued."""
        num_saved = self._num_saved.get(request.request_id)
        if num_saved is None:
            return 0
        num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        if num_full <= num_saved:
            return 0
        self._num_saved[request.request_id] = num_full
        if self.store.epoch != self._known_epoch:
            self._known.clear()
            self._known_epoch = self.store.epoch
        refs = block_refs(
            self._hashes(request), request.all_token_ids, self.block_size, num_saved, num_full
        )
        todo = [
            (ref, block_id)
            for ref, block_id in zip(refs, request.block_table[num_saved:num_full], strict=True)
            if ref.block_hash not in self._known
        ]
        if not todo:
            return 0
        num_queued = self.store.write([r for r, _ in todo], self.cache, [b for _, b in todo])
        if num_queued == len(todo):  # partly dropped: unknown which, so none is remembered
            self._remember(r.block_hash for r, _ in todo)
        return num_queued

    def _remember(self, block_hashes) -> None:
        for block_hash in block_hashes:
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
        while len(self._known) > MAX_KNOWN_BLOCKS:
            self._known.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def _hashes(self, request: Request) -> list[int]:
        """`request.block_hashes` over all its full blocks (the block manager extends them
        only when prefix caching is on; the chain is the same either way)."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        return request.block_hashes
