from pdserve.core.block_manager import chained_block_hash, extend_block_hashes
from pdserve.router.prefix_index import PrefixIndex


def prompt_block_hashes(token_ids, block_size):
    return extend_block_hashes([], token_ids, block_size)


def test_block_hashes_are_the_block_managers_chained_hashes_of_full_blocks():
    tokens = list(range(10))
    hashes = prompt_block_hashes(tokens, block_size=4)
    first = chained_block_hash(None, tokens[0:4])
    assert hashes == [first, chained_block_hash(first, tokens[4:8])]  # 2 left over: no hash


def test_match_is_the_longest_prefix_routed_to_that_worker():
    index = PrefixIndex(block_size=4, max_blocks_per_worker=100)
    shared = list(range(8))
    index.record("a", prompt_block_hashes([*shared, 50, 51, 52, 53], 4))
    query = prompt_block_hashes([*shared, 60, 61, 62, 63], 4)
    assert index.num_cached_tokens("a", query) == 8
    assert index.num_cached_tokens("b", query) == 0
    # Same later block content after a different prefix does not count (chained hashes).
    assert index.num_cached_tokens("a", prompt_block_hashes([9] * 4 + [50, 51, 52, 53], 4)) == 0


def test_least_recently_routed_blocks_are_forgotten_first():
    index = PrefixIndex(block_size=2, max_blocks_per_worker=3)
    old = prompt_block_hashes([1, 2, 3, 4], 2)
    index.record("a", old)
    index.record("a", prompt_block_hashes([7, 8, 9, 10], 2))
    assert index.num_cached_tokens("a", old) == 0  # its first block was evicted
    index.remove_worker("a")
    assert index.num_cached_tokens("a", prompt_block_hashes([7, 8, 9, 10], 2)) == 0


def test_with_a_shared_store_a_prefix_counts_on_every_worker_of_every_pool():
    from pdserve.router.policies import PoolRole, PrefixAware, WorkerLoad

    store = PrefixIndex(block_size=4, max_blocks_per_worker=100)
    prefill = PrefixIndex(block_size=4, max_blocks_per_worker=100, shared_store=store)
    decode = PrefixIndex(block_size=4, max_blocks_per_worker=100, shared_store=store)
    system = list(range(16))
    prefill.record("p0", prompt_block_hashes([*system, 90, 91, 92, 93], 4))
    query = prompt_block_hashes([*system, 70, 71, 72, 73], 4)
    # Written to the store by p0: readable by the other prefill worker and by decode workers.
    assert prefill.num_cached_tokens("p1", query) == 16
    assert decode.num_cached_tokens("d0", query) == 16
    assert PrefixIndex(4, 100).num_cached_tokens("p1", query) == 0  # no store: no belief
    # Every worker matches alike, so load decides: no hot spot on p0.
    loads = [
        WorkerLoad(num_running=3, num_cached_tokens=prefill.num_cached_tokens("p0", query)),
        WorkerLoad(num_cached_tokens=prefill.num_cached_tokens("p1", query)),
    ]
    assert PrefixAware(PoolRole.DECODE).select(loads, 20) == 1
