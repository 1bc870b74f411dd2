import pytest

from pdserve.core.block_manager import BlockManager, chained_block_hash
from tests.core.helpers import make_request


def _admit(manager: BlockManager, request, num_new: int | None = None) -> list[int]:
    computed = manager.get_computed_blocks(request)
    hit = len(computed) * manager.block_size
    num_new = request.num_tokens - hit if num_new is None else num_new
    assert manager.allocate_slots(request, num_new, computed)
    request.num_computed_tokens += num_new
    manager.cache_full_blocks(request)
    return computed


def test_allocate_and_free_returns_every_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", 10)
    _admit(manager, request)
    assert len(request.block_table) == 3
    assert manager.num_free_blocks == 5
    manager.free(request)
    assert manager.num_free_blocks == 8
    assert request.block_table == []


def test_allocation_fails_atomically_when_blocks_run_out():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request("a", 12)
    assert not manager.allocate_slots(request, 12)
    assert request.block_table == [] and manager.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_counts_refs():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_request("a", 10)
    _admit(manager, first)
    second = make_request("b", 10)
    computed = _admit(manager, second)
    # 10 tokens = 2 full blocks; both shared, the partial third block is not.
    assert computed == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert manager.blocks[computed[0]].ref_count == 2
    manager.free(first)
    assert manager.blocks[computed[0]].ref_count == 1
    manager.free(second)
    assert manager.num_free_blocks == 16


def test_hit_always_leaves_a_token_to_compute():
    manager = BlockManager(num_blocks=16, block_size=4)
    _admit(manager, make_request("a", 8))
    again = make_request("b", 8)
    assert len(manager.get_computed_blocks(again)) == 1  # not 2: the last token must run


def test_freed_cached_blocks_survive_until_evicted_lru():
    manager = BlockManager(num_blocks=4, block_size=4)
    old = make_request("old", 8, first_token=100)
    _admit(manager, old)
    manager.free(old)
    # The cached blocks are free but still hit.
    assert len(manager.get_computed_blocks(make_request("x", 9, first_token=100))) == 2
    filler = make_request("filler", 16, first_token=500)
    _admit(manager, filler)  # needs all four blocks: evicts the cached ones
    assert manager.get_computed_blocks(make_request("y", 9, first_token=100)) == []


def test_empty_blocks_are_used_before_cached_ones_are_evicted():
    manager = BlockManager(num_blocks=6, block_size=4)
    cached = make_request("cached", 8, first_token=100)
    _admit(manager, cached)  # two full blocks, cached
    partial = make_request("partial", 3, first_token=300)
    _admit(manager, partial)  # one block, never full: no content worth keeping
    manager.free(cached)
    manager.free(partial)
    # Five blocks needed: the freed empty one, the three never used, then the least
    # recently freed cached block; the other cached block still hits.
    _admit(manager, make_request("new", 20, first_token=500))
    assert len(manager.get_computed_blocks(make_request("again", 9, first_token=100))) == 1


@pytest.mark.timeout(10)
def test_a_huge_cache_costs_nothing_until_used():
    manager = BlockManager(num_blocks=10**9, block_size=16)
    request = make_request("a", 100)
    _admit(manager, request)
    assert manager.num_free_blocks == 10**9 - 7
    manager.free(request)
    assert manager.num_free_blocks == 10**9 and manager.usage == 0.0


def test_hash_collision_is_verified_not_trusted():
    manager = BlockManager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: 42)
    _admit(manager, make_request("a", 9, first_token=100))
    other = make_request("b", 9, first_token=300)  # same (constant) hash, different tokens
    assert manager.get_computed_blocks(other) == []


def test_chained_hash_depends_on_parent():
    tokens = [1, 2, 3, 4]
    assert chained_block_hash(None, tokens) != chained_block_hash(
        chained_block_hash(None, [9]), tokens
    )
    assert chained_block_hash(None, tokens) == chained_block_hash(None, list(tokens))


def test_prefix_caching_disabled_never_hits():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    _admit(manager, make_request("a", 9))
    assert manager.get_computed_blocks(make_request("b", 9)) == []


def test_hit_rate_counts_prompt_tokens():
    manager = BlockManager(num_blocks=16, block_size=4)
    _admit(manager, make_request("a", 8))
    _admit(manager, make_request("b", 8))
    assert manager.prefix_cache_hit_rate == 4 / 16


def test_each_full_block_is_hashed_once_however_often_it_is_looked_up():
    calls = []

    def counting_hash(parent, token_ids):
        calls.append(tuple(token_ids))
        return chained_block_hash(parent, token_ids)

    manager = BlockManager(num_blocks=2, block_size=4, hash_fn=counting_hash)
    request = make_request("blocked", 13)  # 3 full blocks; needs 4 blocks, only 2 exist
    for _ in range(5):  # a waiting prompt looked up on every step it stays blocked
        manager.get_computed_blocks(request)
        assert not manager.allocate_slots(request, 13)
    assert len(calls) == 3
    assert request.block_hashes == [
        chained_block_hash(None, [100, 101, 102, 103]),
        chained_block_hash(request.block_hashes[0], [104, 105, 106, 107]),
        chained_block_hash(request.block_hashes[1], [108, 109, 110, 111]),
    ]


def test_the_packed_chain_equals_the_hash_spelled_out():
    import hashlib
    import random

    from pdserve.core.block_manager import extend_block_hashes

    def spelled_out(parent, token_ids):  # the chain's definition, one token at a time
        data = (parent or 0).to_bytes(8, "little")
        data += b"".join(t.to_bytes(4, "little") for t in token_ids)
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    rng = random.Random(0)
    tokens = [rng.randrange(2**32) for _ in range(16 * 9 + 5)]
    expected, parent = [], None
    for start in range(0, 16 * 9, 16):
        parent = spelled_out(parent, tokens[start : start + 16])
        expected.append(parent)
    assert extend_block_hashes([], tokens, 16) == expected
    assert extend_block_hashes(expected[:4], tokens, 16) == expected  # resumed mid-chain
    assert chained_block_hash(expected[0], tokens[16:32]) == expected[1]
