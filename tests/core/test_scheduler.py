import pytest

from pdserve.core.config import SchedulerConfig
from pdserve.core.request import FinishReason, RequestStatus
from tests.core.helpers import make_request, make_scheduler, run_to_completion, step


def _plan(output):
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def test_chunked_budget_respected_and_decodes_first():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("short", 3, max_tokens=10))
    step(scheduler)  # "short" prefilled, now decoding
    scheduler.add_request(make_request("long", 20))
    output, _ = step(scheduler)
    assert _plan(output) == [("short", 1), ("long", 7)]
    output, _ = step(scheduler)
    assert _plan(output) == [("short", 1), ("long", 7)]
    assert all(o.num_batched_tokens <= 8 for o, _ in run_to_completion(scheduler))


def test_colocated_prefills_whole_prompt_and_stalls_decodes():
    scheduler = make_scheduler(scheduling="colocated", max_num_batched_tokens=64)
    scheduler.add_request(make_request("short", 3, max_tokens=10))
    step(scheduler)
    scheduler.add_request(make_request("long", 40))
    output, _ = step(scheduler)
    assert _plan(output) == [("long", 40)]  # the decode of "short" waits a whole step
    output, _ = step(scheduler)
    assert _plan(output) == [("short", 1), ("long", 1)]


def test_fcfs_admission():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    output, _ = step(scheduler)
    assert _plan(output) == [("a", 3), ("b", 3)]


def test_max_num_seqs_caps_running_batch():
    scheduler = make_scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    output, _ = step(scheduler)
    assert [r for r, _ in _plan(output)] == ["a", "b"]
    assert len(scheduler.waiting) == 1


def test_long_prefill_threshold_caps_one_chunk():
    scheduler = make_scheduler(
        max_num_batched_tokens=32, long_prefill_token_threshold=5, max_num_partial_prefills=2
    )
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 20, first_token=300))
    output, _ = step(scheduler)
    assert _plan(output) == [("a", 5), ("b", 5)]


def test_prompt_alone_takes_the_whole_budget_until_another_request_arrives():
    scheduler = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=5)
    scheduler.add_request(make_request("a", 40))
    output, _ = step(scheduler)
    assert _plan(output) == [("a", 16)]  # nobody to stall: not capped at 5
    scheduler.add_request(make_request("b", 3, first_token=300))
    output, _ = step(scheduler)
    assert _plan(output) == [("a", 5), ("b", 3)]


def test_max_num_partial_prefills_limits_concurrent_chunking():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 20, first_token=300))
    output, _ = step(scheduler)
    assert _plan(output) == [("a", 8)]  # "b" would be a second partial prefill


def test_request_finishes_with_max_tokens_and_frees_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, max_tokens=3))
    outputs = run_to_completion(scheduler)
    finished = [r for _, fin in outputs for r in fin]
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].num_output_tokens == 3
    assert finished[0].finish_reason is FinishReason.LENGTH
    assert scheduler.block_manager.num_free_blocks == 64


def test_eos_stops_unless_ignored():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10)
    request.sampling_params = request.sampling_params.__class__(max_tokens=10)
    scheduler.add_request(request)
    output = scheduler.schedule()
    finished = scheduler.update_from_output(output, {"a": 2})
    assert finished == [request] and request.finish_reason is FinishReason.STOP


def test_abort_frees_blocks_at_any_time():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10, first_token=300))
    step(scheduler)
    assert scheduler.block_manager.num_free_blocks < 64
    aborted = scheduler.abort_request("a")
    scheduler.abort_request("b")  # still waiting
    assert aborted.finish_reason is FinishReason.ABORT
    assert aborted.status is RequestStatus.FINISHED
    assert scheduler.block_manager.num_free_blocks == 64
    assert not scheduler.has_unfinished_requests()
    assert scheduler.abort_request("a") is None


def test_preemption_recomputes_and_never_deadlocks():
    # 6 blocks of 4 tokens = 24 slots; three requests of 10 + 8 tokens cannot all fit.
    scheduler = make_scheduler(
        num_blocks=6, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, 10, max_tokens=8, first_token=100 * (i + 1)))
    outputs = run_to_completion(scheduler)
    finished = {r.request_id: r for _, fin in outputs for r in fin}
    assert set(finished) == {"a", "b", "c"}
    assert all(r.num_output_tokens == 8 for r in finished.values())
    assert scheduler.num_preemptions > 0
    assert scheduler.block_manager.num_free_blocks == 6


def test_preempted_output_matches_unpreempted_run():
    def tokens(num_blocks):
        scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16)
        for i, name in enumerate("abc"):
            scheduler.add_request(make_request(name, 10, max_tokens=8, first_token=100 * i))
        outputs = run_to_completion(scheduler)
        return {r.request_id: r.output_token_ids for _, fin in outputs for r in fin}

    assert tokens(num_blocks=6) == tokens(num_blocks=64)


def test_prefix_hit_skips_computation():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 17, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", 17, max_tokens=1))
    output, _ = step(scheduler)
    assert _plan(output) == [("b", 1)]  # 16 tokens from the cache
    assert scheduler.block_manager.num_free_blocks == 64


def test_duplicate_request_id_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="request_id"):
        scheduler.add_request(make_request("a", 3))


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(scheduling="bogus")
