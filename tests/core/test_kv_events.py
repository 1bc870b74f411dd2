import random

from pdserve.core.block_manager import BlockManager
from pdserve.core.kv_events import KVEventKind, KVEventLog
from tests.core.helpers import make_request


def _admit(manager: BlockManager, request) -> None:
    computed = manager.get_computed_blocks(request)
    num_new = request.num_tokens - len(computed) * manager.block_size
    assert manager.allocate_slots(request, num_new, computed)
    request.num_computed_tokens += num_new
    manager.cache_full_blocks(request)


def _replay(log: KVEventLog) -> set[int]:
    cached: set[int] = set()
    for event in log.events_after(log.epoch, 0):
        if event.kind is KVEventKind.STORED:
            cached.update(event.block_hashes)
        else:
            cached.difference_update(event.block_hashes)
    return cached


def test_events_replayed_in_order_equal_the_block_managers_cache_through_evictions():
    manager = BlockManager(num_blocks=12, block_size=4)
    log = manager.cache_observer = KVEventLog()
    rng = random.Random(0)
    for i in range(60):  # many more blocks than fit: most are evicted again
        request = make_request(f"r{i}", rng.randrange(5, 30), first_token=rng.choice([0, 50, 900]))
        _admit(manager, request)
        manager.free(request)
        assert _replay(log) == set(manager.cached_block_hashes())
    kinds = {event.kind for event in log.events_after(log.epoch, 0)}
    assert kinds == {KVEventKind.STORED, KVEventKind.REMOVED}
    seqs = [event.seq for event in log.events_after(log.epoch, 0)]
    assert seqs == list(range(1, log.seq + 1))
    snapshot = log.snapshot()
    assert snapshot.seq == log.seq and set(snapshot.block_hashes) == _replay(log)


def test_a_reader_too_far_behind_or_of_another_epoch_needs_a_snapshot():
    log = KVEventLog(max_events=3)
    for h in range(5):
        log.blocks_stored([h])
    assert [e.seq for e in log.events_after(log.epoch, 2)] == [3, 4, 5]
    assert log.events_after(log.epoch, 1) is None  # event 2 was dropped
    assert log.events_after(log.epoch, 5) == []
    assert log.events_after("another process", 5) is None
    assert log.events_after(log.epoch, 6) is None  # from the future: not this log's history
    assert set(log.snapshot().block_hashes) == {0, 1, 2, 3, 4}


def test_listeners_hear_every_event_and_empty_changes_are_not_events():
    log = KVEventLog()
    heard = []
    log.add_listener(lambda: heard.append(log.seq))
    log.blocks_stored([1, 2])
    log.blocks_removed([])
    log.blocks_removed([1])
    assert heard == [1, 2]
