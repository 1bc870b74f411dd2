"""What routing knows about a prompt (its length and its full blocks' chained hashes), and the
router's belief of which prompt prefixes each worker has cached.

The index records the full-block chained hashes (`core.block_manager.extend_block_hashes`,
the same chain the workers' block managers compute) of every prompt routed to a worker. A later
prompt's cached prefix on that worker is the longest run of its block hashes, from the first,
that the index holds. It is a belief, not the truth: a worker may have evicted blocks since, so
each worker's entries are bounded and least recently routed ones are forgotten first.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.core.block_manager import BlockHash, extend_block_hashes

# Rough bytes of text per token for English BPE vocabularies; used only when the prompt could
# not be tokenized, to weigh prefill load.
_BYTES_PER_TOKEN_ESTIMATE = 4


@dataclass(frozen=True)
class PromptInfo:
    num_tokens: int
    # Empty when the token ids are unknown (then nothing is believed cached anywhere).
    block_hashes: tuple[BlockHash, ...] = ()

    @classmethod
    def from_token_ids(cls, token_ids: Sequence[int], block_size: int) -> PromptInfo:
        return cls(len(token_ids), tuple(extend_block_hashes([], token_ids, block_size)))

    @classmethod
    def estimate(cls, body: dict[str, Any]) -> PromptInfo:
        """Length guessed from the prompt or messages' JSON size; no block hashes."""
        source = body.get("messages", body.get("prompt", ""))
        num_bytes = len(json.dumps(source, ensure_ascii=False).encode())
        return cls(max(1, num_bytes // _BYTES_PER_TOKEN_ESTIMATE))


class PrefixIndex:
    """Per worker, an LRU set of block hashes of the prompts routed there.

    With `shared_store` (the workers share a KV store, `--kv-store`; one index for all pools)
    a prefix routed to any worker is believed cached on every worker too, up to what the store
    index holds: every worker then matches equally, so load, not prefix affinity, picks among
    them (no hot spot of all requests with one system prompt on one worker).
    """

    _STORE = "<kv store>"

    def __init__(
        self,
        block_size: int,
        max_blocks_per_worker: int,
        shared_store: PrefixIndex | None = None,
    ) -> None:
        if block_size < 1 or max_blocks_per_worker < 1:
            raise ValueError("block_size and max_blocks_per_worker must be positive")
        self.block_size = block_size
        self.max_blocks_per_worker = max_blocks_per_worker
        self.shared_store = shared_store
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}

    def num_cached_tokens(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Tokens of the longest prefix of `block_hashes` believed cached on the worker (or,
        with a shared store, readable from it)."""
        own = self._num_cached(worker_id, block_hashes)
        if self.shared_store is None:
            return own
        return max(own, self.shared_store._num_cached(self._STORE, block_hashes))

    def _num_cached(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> int:
        cached = self._blocks.get(worker_id)
        if not cached:
            return 0
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in cached:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def record(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The prompt with these block hashes was routed to the worker (it will cache them,
        and write them to the shared store)."""
        if self.shared_store is not None:
            self.shared_store.record(self._STORE, block_hashes)
        cached = self._blocks.setdefault(worker_id, OrderedDict())
        for block_hash in block_hashes:
            cached[block_hash] = None
            cached.move_to_end(block_hash)
        while len(cached) > self.max_blocks_per_worker:
            cached.popitem(last=False)

    def remove_worker(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
