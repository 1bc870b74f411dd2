"""Paged KV-cache block manager with prefix caching.

Blocks are fixed-size pages of the KV cache. A request owns an ordered `block_table`; a token
at position p lives in block `block_table[p // block_size]`. Full blocks are content-addressed
by a chained hash (parent hash + the block's token ids), so a later request whose prompt starts
with the same tokens reuses them instead of recomputing.

Invariants:
- A block is in exactly one of: never used (ids from `_num_used_ids` up, created on first
  use so a large cache costs nothing up front), the free queue (ref_count == 0), or some block
  tables (ref_count == number of tables holding it).
- A free block may still hold cached content (its hash stays registered) until it is evicted,
  least recently freed first, when a fresh block is needed and no empty one is left. Freed
  blocks without content sit at the front of the free queue, cached ones at the back.
- A hash hit is verified against the stored token ids and parent hash before reuse, so a hash
  collision can only cost a cache miss, never a wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.core.kv_events import KVCacheObserver
from pdserve.core.request import Request

BlockHash = int
HashFn = Callable[[BlockHash | None, Sequence[int]], BlockHash]


def chained_block_hash(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """64-bit BLAKE2b of the parent block's hash (8 bytes, little-endian; 0 for none) and this
    block's token ids (4 bytes each, little-endian).

    Stable across processes (unlike Python's `hash`), so workers and routers agree.
    """
    return _chained_hash(parent or 0, struct.pack(f"<{len(token_ids)}I", *token_ids))


def _chained_hash(parent: BlockHash, token_bytes: bytes) -> BlockHash:
    digest = hashlib.blake2b(parent.to_bytes(8, "little") + token_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFn = chained_block_hash,
) -> list[BlockHash]:
    """Append to `hashes` (the chain of `token_ids`' first full blocks) the hashes of the
    full blocks after them; a partial last block has none. Returns `hashes`."""
    parent = hashes[-1] if hashes else None
    start = len(hashes) * block_size
    stop = start + (len(token_ids) - start) // block_size * block_size
    if hash_fn is chained_block_hash:
        # The same hashes, 3x faster: every block's token bytes packed at once (a router
        # hashes each prompt it routes).
        data = struct.pack(f"<{stop - start}I", *token_ids[start:stop])
        step = 4 * block_size
        for offset in range(0, len(data), step):
            parent = _chained_hash(parent or 0, data[offset : offset + step])
            hashes.append(parent)
        return hashes
    for begin in range(start, stop, block_size):
        parent = hash_fn(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None

    def reset(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None


class BlockManager:
    """Allocates KV blocks to requests; shares and caches full blocks by content."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = chained_block_hash,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        # Blocks ever used, by id; ids from `_num_used_ids` up are free and empty.
        self.blocks: dict[int, Block] = {}
        self._num_used_ids = 0
        # Free blocks once used, in reuse order: empty ones first, then cached content
        # least recently freed first (the eviction order).
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        # Per request: how many of its leading full blocks are registered in the cache.
        self._num_registered: dict[str, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of which found in the cache
        # Told what enters and leaves the prefix cache (a worker's `KVEventLog`).
        self.cache_observer = KVCacheObserver()

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._num_used_ids

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached full blocks matching the start of `request`'s tokens.

        At least one token is always left to compute, so the request can produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        hashes = self._block_hashes(request)
        hit: list[int] = []
        for i in range((len(tokens) - 1) // self.block_size):
            block_id = self._cached.get(hashes[i])
            parent = hashes[i - 1] if i else None
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            if block_id is None or not self._verify(self.blocks[block_id], parent, chunk):
                break
            hit.append(block_id)
        return hit

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow `request.block_table` to hold its computed tokens plus `num_new_tokens`.

        `computed_blocks` (from `get_computed_blocks`, only for a request holding no blocks)
        are shared rather than allocated, and the request's `num_computed_tokens` advances
        past them. Returns False, changing nothing, when there are not enough free blocks.
        """
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = self.num_blocks_needed(total) - len(request.block_table) - len(computed_blocks)
        # Hit blocks sitting in the free queue are taken out of it, so they don't count as free.
        num_hits_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_needed > self.num_free_blocks - num_hits_free:
            return False
        if not request.block_table and self.enable_prefix_caching:  # an admission
            self.num_prefix_queries += request.num_prompt_tokens
            self.num_prefix_hits += min(num_hit_tokens, request.num_prompt_tokens)
        for block_id in computed_blocks:
            self._take(block_id)
        request.block_table.extend(computed_blocks)
        if computed_blocks:
            request.num_computed_tokens += num_hit_tokens
            request.num_cached_tokens = num_hit_tokens
            self._num_registered[request.request_id] = len(computed_blocks)
        for _ in range(max(num_needed, 0)):
            request.block_table.append(self._allocate_fresh())
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_registered = self._num_registered.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        if num_full <= num_registered:  # most decode steps complete no block
            return
        hashes = self._block_hashes(request)
        tokens = request.all_token_ids
        stored = []
        for i in range(num_registered, num_full):
            block = self.blocks[request.block_table[i]]
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash, block.parent_hash = hashes[i], hashes[i - 1] if i else None
                block.token_ids = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                self._cached[hashes[i]] = block.block_id
                stored.append(hashes[i])
        self._num_registered[request.request_id] = num_full
        if stored:
            self.cache_observer.blocks_stored(stored)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (a copy: safe to call from another thread,
        the copy being one step under the GIL)."""
        return list(self._cached.copy())

    def free(self, request: Request) -> None:
        """Return the request's blocks. Freed in reverse, so a sequence's tail is evicted first
        and its shared prefix stays cached longest."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:  # nothing cached: reuse it first
                    self._free.move_to_end(block_id, last=False)
        request.block_table = []
        self._num_registered.pop(request.request_id, None)

    # ---- internals ---------------------------------------------------------------------
    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """`request.block_hashes`, extended over blocks that have filled up since."""
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, self._hash_fn)
        return hashes

    def _verify(self, block: Block, parent: BlockHash | None, chunk: Sequence[int]) -> bool:
        return block.parent_hash == parent and block.token_ids == tuple(chunk)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        """An empty block: a freed empty one, else a never-used one, else the least
        recently freed cached one, its content evicted."""
        front = next(iter(self._free), None)
        if (
            front is None or self.blocks[front].block_hash is not None
        ) and self._num_used_ids < self.num_blocks:
            block = self.blocks[self._num_used_ids] = Block(self._num_used_ids)
            self._num_used_ids += 1
        else:
            block = self.blocks[self._free.popitem(last=False)[0]]
        if block.block_hash is not None:  # evict cached content
            del self._cached[block.block_hash]
            self.cache_observer.blocks_removed([block.block_hash])
            block.reset()
        block.ref_count = 1
        return block.block_id
