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
from collections.abc import Collection, Iterable, Sequence
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
    # Empty when the token ids are unknown (then nothing counts as cached anywhere).
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
    counts on every worker as far as the store holds it: the union of what the workers' store
    events say (each worker reports the writes it queued, which a reader waits for, and those
    it landed, and the blocks it found gone or failed to write; a gone block leaves every
    worker's share). Every worker then matches alike, so load, not
    affinity, picks among them.
    """

    def __init__(self, block_size: int, shared_store: bool = False) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.shared_store = shared_store
        self._blocks: dict[str, set[BlockHash]] = {}
        # Per worker, the store blocks its events named; per block, how many workers name it.
        self._store_by_worker: dict[str, set[BlockHash]] = {}
        self._store: dict[BlockHash, int] = {}

    def num_cached_tokens(
        self, url: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int
    ) -> int:
        """Prompt tokens the worker at `url` will find cached (or, with a shared store, read
        from it): the longest indexed prefix of `block_hashes`, never the last token."""
        limit = min(len(block_hashes), (num_prompt_tokens - 1) // self.block_size)
        hashes = block_hashes[:limit]
        own = _num_matched(self._blocks.get(url), hashes)
        if self.shared_store and own < limit:
            own = max(own, _num_matched(self._store, hashes))
        return own * self.block_size

    @property
    def num_store_blocks(self) -> int:
        return len(self._store)

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
        self.replace_store(url, ())

    def replace_store(self, url: str, block_hashes: Iterable[BlockHash]) -> None:
        """A snapshot of what the worker knows the store holds."""
        for block_hash in self._store_by_worker.pop(url, ()):
            self._unname(block_hash)
        self.add_store(url, block_hashes)

    def add_store(self, url: str, block_hashes: Iterable[BlockHash]) -> None:
        named = self._store_by_worker.setdefault(url, set())
        for block_hash in block_hashes:
            if block_hash not in named:
                named.add(block_hash)
                self._store[block_hash] = self._store.get(block_hash, 0) + 1

    def discard_store(self, block_hashes: Iterable[BlockHash]) -> None:
        """Gone from the store (whoever wrote them)."""
        for block_hash in block_hashes:
            if self._store.pop(block_hash, None) is not None:
                for named in self._store_by_worker.values():
                    named.discard(block_hash)

    def _unname(self, block_hash: BlockHash) -> None:
        count = self._store.get(block_hash, 0) - 1
        if count > 0:
            self._store[block_hash] = count
        else:
            self._store.pop(block_hash, None)

    def feed(self, url: str) -> KVCacheObserver:
        """A block manager's observer that applies its changes here as they happen."""
        return _DirectFeed(self, url)


def _num_matched(cached: Collection[BlockHash] | None, block_hashes: Sequence[BlockHash]) -> int:
    """How many of `block_hashes`, from the first on, are in `cached`."""
    if not cached:
        return 0
    num_blocks = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        num_blocks += 1
    return num_blocks


class _DirectFeed(KVCacheObserver):
    def __init__(self, index: PrefixIndex, url: str) -> None:
        self._index = index
        self._url = url

    def blocks_stored(self, block_hashes: list[BlockHash]) -> None:
        self._index.add(self._url, block_hashes)

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        self._index.discard(self._url, block_hashes)
