from pdserve.core.block_manager import chained_block_hash, extend_block_hashes
from pdserve.router.policies import PoolRole, PrefixAware, WorkerLoad
from pdserve.router.prefix_index import PrefixIndex


def prompt_block_hashes(token_ids, block_size):
    return extend_block_hashes([], token_ids, block_size)


def test_block_hashes_are_the_block_managers_chained_hashes_of_full_blocks():
    tokens = list(range(10))
    hashes = prompt_block_hashes(tokens, block_size=4)
    first = chained_block_hash(None, tokens[0:4])
    assert hashes == [first, chained_block_hash(first, tokens[4:8])]  # 2 left over: no hash


def test_match_is_the_longest_indexed_prefix_on_that_worker():
    index = PrefixIndex(block_size=4)
    shared = list(range(8))
    index.add("a", prompt_block_hashes([*shared, 50, 51, 52, 53], 4))
    query = prompt_block_hashes([*shared, 60, 61, 62, 63], 4)
    assert index.num_cached_tokens("a", query, 13) == 8
    assert index.num_cached_tokens("b", query, 13) == 0
    # Same later block content after a different prefix does not count (chained hashes).
    other = prompt_block_hashes([9] * 4 + [50, 51, 52, 53], 4)
    assert index.num_cached_tokens("a", other, 9) == 0


def test_a_hit_never_covers_the_last_token_as_the_worker_computes_it():
    index = PrefixIndex(block_size=4)
    hashes = prompt_block_hashes(list(range(8)), 4)
    index.add("a", hashes)
    assert index.num_cached_tokens("a", hashes, 8) == 4  # the second block holds the last token
    assert index.num_cached_tokens("a", hashes, 9) == 8


def test_removed_blocks_end_the_match_and_a_snapshot_replaces_everything():
    index = PrefixIndex(block_size=2)
    hashes = prompt_block_hashes([1, 2, 3, 4, 5, 6], 2)
    index.add("a", hashes)
    index.discard("a", hashes[1:2])
    assert index.num_cached_tokens("a", hashes, 7) == 2
    assert index.num_blocks("a") == 2
    index.replace("a", hashes[1:])
    assert index.num_cached_tokens("a", hashes, 7) == 0  # its first block is gone
    index.forget("a")
    assert index.num_blocks("a") == 0


def test_with_a_shared_store_what_the_store_holds_counts_on_every_worker():
    index = PrefixIndex(block_size=4, shared_store=True)
    system = list(range(16))
    query = prompt_block_hashes([*system, 70, 71, 72, 73], 4)
    # Nothing is assumed: a prefix counts once the store's own entries hold it.
    assert index.num_cached_tokens("p1", query, 21) == 0
    written = prompt_block_hashes([*system, 90, 91, 92, 93], 4)
    index.add_store("p0", written[:2])  # p0 wrote the first half, p2 the rest
    index.add_store("p2", written[2:])
    index.add("p0", query[:1])
    assert index.num_cached_tokens("p1", query, 21) == 16
    assert index.num_cached_tokens("p0", query, 21) == 16
    plain = PrefixIndex(4)
    plain.add_store("p0", written)
    assert plain.num_cached_tokens("p1", query, 21) == 0  # no shared store: only own
    # Every worker matches alike, so load decides: no hot spot on p0.
    loads = [
        WorkerLoad(num_running=3, num_cached_tokens=index.num_cached_tokens("p0", query, 21)),
        WorkerLoad(num_cached_tokens=index.num_cached_tokens("p1", query, 21)),
    ]
    assert PrefixAware(PoolRole.DECODE).select(loads, 20) == 1


def test_a_block_managers_feed_keeps_the_index_equal_to_its_cache():
    from pdserve.core.block_manager import BlockManager
    from tests.core.helpers import make_request

    index = PrefixIndex(block_size=4)
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.cache_observer = index.feed("sim://w")
    for i in range(10):
        request = make_request(f"r{i}", 11, first_token=10 * i)
        assert manager.allocate_slots(request, 11)
        request.num_computed_tokens = 11
        manager.cache_full_blocks(request)
        manager.free(request)
        assert index.num_blocks("sim://w") == len(manager.cached_block_hashes())


def test_a_block_gone_from_the_store_leaves_every_workers_share_and_snapshots_recount():
    index = PrefixIndex(block_size=2, shared_store=True)
    hashes = prompt_block_hashes([1, 2, 3, 4, 5, 6], 2)
    index.add_store("a", hashes)
    index.add_store("b", hashes[:2])
    assert index.num_cached_tokens("c", hashes, 7) == 6
    index.discard_store(hashes[1:2])  # b's lookup found it evicted
    assert index.num_cached_tokens("c", hashes, 7) == 2
    index.replace_store("a", ())
    assert index.num_store_blocks == 1  # b still names the first
    index.forget("b")
    assert index.num_store_blocks == 0
