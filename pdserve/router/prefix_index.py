"""What routing knows about a prompt (its length and its full blocks' chained hashes), and
what each worker's prefix cache holds.

The index holds, per worker (by URL: a worker that switches pools keeps its cache), the
chained block hashes (`core.block_manager.extend_block_hashes`, the chain every block manager
computes) its KV events say it caches (`router.kv_events` applies them as they arrive; the
simulator feeds it from its workers' block managers directly). A prompt's cached prefix on a
worker is the longest run of its block hashes, from the first, that the worker holds, capped as
the worker caps a hit (one token is always computed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.core.block_manager import BlockHash, extend_block_hashes
from pdserve.core.kv_events import KVCacheObserver

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
    """Per worker URL, the set of block hashes in its prefix cache.

    With `shared_store` (the workers share a KV store, `--kv-store`) a prompt's prefix also
    counts on every worker as far as the store holds it, per the store's own entries
    (`STORE`, fed like a worker's): every worker then matches alike, so load, not affinity,
    picks among them.
    """

    STORE = "<kv store>"

    def __init__(self, block_size: int, shared_store: bool = False) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.shared_store = shared_store
        self._blocks: dict[str, set[BlockHash]] = {}

    def num_cached_tokens(
        self, url: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int
    ) -> int:
        """Prompt tokens the worker at `url` will find cached (or, with a shared store, read
        from it): the longest indexed prefix of `block_hashes`, never the last token."""
        limit = min(len(block_hashes), (num_prompt_tokens - 1) // self.block_size)
        hashes = block_hashes[:limit]
        own = self._num_matched(url, hashes)
        if self.shared_store and own < limit:
            own = max(own, self._num_matched(self.STORE, hashes))
        return own * self.block_size

    def _num_matched(self, source: str, block_hashes: Sequence[BlockHash]) -> int:
        cached = self._blocks.get(source)
        if not cached:
            return 0
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in cached:
                break
            num_blocks += 1
        return num_blocks

    def num_blocks(self, url: str) -> int:
        return len(self._blocks.get(url, ()))

    def replace(self, url: str, block_hashes: Iterable[BlockHash]) -> None:
        """A snapshot: the worker caches exactly these."""
        self._blocks[url] = set(block_hashes)

    def add(self, url: str, block_hashes: Iterable[BlockHash]) -> None:
        self._blocks.setdefault(url, set()).update(block_hashes)

    def discard(self, url: str, block_hashes: Iterable[BlockHash]) -> None:
        self._blocks.get(url, set()).difference_update(block_hashes)

    def forget(self, url: str) -> None:
        self._blocks.pop(url, None)

    def feed(self, url: str) -> KVCacheObserver:
        """A block manager's observer that applies its changes here as they happen."""
        return _DirectFeed(self, url)


class _DirectFeed(KVCacheObserver):
    def __init__(self, index: PrefixIndex, url: str) -> None:
        self._index = index
        self._url = url

    def blocks_stored(self, block_hashes: list[BlockHash]) -> None:
        self._index.add(self._url, block_hashes)

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        self._index.discard(self._url, block_hashes)
