from dataclasses import replace

import pytest

import pdserve.core.scheduler as core_scheduler
from pdserve.core.config import CacheConfig, Mode
from pdserve.router.config import KVHandoff, RouterConfig
from pdserve.sim.config import with_scheduler
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.handoff import exposed_seconds, predicted_ttft
from pdserve.sim.network import get_network
from pdserve.sim.simulator import Simulation, simulate
from pdserve.sim.workload import SimRequestSpec
from tests.sim.helpers import make_config, poisson_specs, streams_plus_long_prompt


def _timelines(result):
    return [(r.send_time, tuple(r.token_times), r.error) for r in result.records]


@pytest.mark.parametrize("mode", list(Mode))
def test_deterministic_for_a_seed(mode):
    config = make_config(mode, num_workers=2)
    first = simulate(config, poisson_specs(60, 20.0, seed=1))
    again = simulate(config, poisson_specs(60, 20.0, seed=1))
    other = simulate(config, poisson_specs(60, 20.0, seed=2))
    assert _timelines(first) == _timelines(again)
    assert _timelines(first) != _timelines(other)


@pytest.mark.parametrize("mode", list(Mode))
def test_conservation_every_request_finishes_or_is_reported(mode):
    specs = poisson_specs(80, 40.0)
    specs.append(SimRequestSpec("too-long", 0.1, 9000, 4))  # over max_model_len 8192
    sim = Simulation(make_config(mode, num_workers=2, max_concurrency=16), specs)
    result = sim.run()
    by_id = {s.request_id: r for s, r in zip(specs, result.records, strict=True)}
    assert by_id["too-long"].error.startswith("rejected")
    for spec, record in zip(specs[:-1], result.records[:-1], strict=True):
        assert record.error is None
        assert record.num_output_tokens == len(record.token_times) == spec.output_len
    # Every KV block came back: nothing leaked through preemption, holds or transfers.
    pools = [p for p in (sim.prefill, sim.main) if p is not None]
    for pool, worker in ((p, w) for p in pools for w in p.workers):
        assert worker.scheduler.block_manager.num_free_blocks == pool.num_kv_blocks
        assert not worker.scheduler.has_unfinished_requests()
        assert not worker.scheduler.held


def test_horizon_reports_requests_still_in_flight():
    result = simulate(make_config(horizon_s=0.05), poisson_specs(50, 200.0))
    incomplete = [r for r in result.records if r.error and r.error.startswith("incomplete")]
    assert incomplete
    assert all(r.error is None or r.error.startswith("incomplete") for r in result.records)


def test_kv_pressure_preempts_and_still_completes():
    specs = [SimRequestSpec(str(i), 0.0, 200, 300) for i in range(16)]
    result = simulate(make_config(cache=CacheConfig(num_blocks=120)), specs)
    assert all(r.error is None for r in result.records)
    assert sum(r.server_extra.get("num_preemptions", 0) for r in result.records) > 0


def test_a_scheduler_config_change_changes_the_simulation():
    specs = poisson_specs(40, 50.0)
    config = make_config()
    narrow = replace(config, pool=with_scheduler(config.pool, max_num_seqs=2))
    assert _timelines(simulate(config, specs)) != _timelines(simulate(narrow, specs))


def test_the_simulator_runs_the_real_core_scheduler(monkeypatch):
    """Change the core scheduler's behaviour and the simulation follows it."""
    calls = []
    real_schedule = core_scheduler.Scheduler.schedule

    def spy(self):
        output = real_schedule(self)
        calls.append(len(output.scheduled))
        return output

    monkeypatch.setattr(core_scheduler.Scheduler, "schedule", spy)
    result = simulate(make_config(), poisson_specs(10, 10.0))
    steps = sum(s.num_steps for stats in result.pool_stats.values() for s in stats)
    assert sum(1 for n in calls if n) == steps > 0


def test_colocated_stalls_streams_chunked_bounds_the_stall():
    specs = streams_plus_long_prompt()
    colocated = simulate(make_config(Mode.COLOCATED, budget=8192), specs)
    chunked = simulate(make_config(Mode.CHUNKED, budget=512), specs)
    # The long prompt alone, prefilled whole (chunks would add their steps' overheads).
    config = make_config(Mode.COLOCATED, budget=8192)
    prefill_s = simulate(config, [specs[-1]]).records[0].ttft

    def worst_stream_gap(result):
        return max(
            max(r.itls) for r in result.records if r.kind == "default" and r.prompt_len == 32
        )

    # Colocated: one stream gap swallows the whole 6,000-token prefill.
    assert worst_stream_gap(colocated) >= 0.9 * prefill_s
    # Chunked at 512: no gap longer than a fraction of that prefill.
    assert worst_stream_gap(chunked) < 0.25 * prefill_s


def test_disagg_moves_kv_and_keeps_streams_smooth():
    specs = streams_plus_long_prompt()
    result = simulate(make_config(Mode.DISAGG, num_workers=1, num_prefill=1), specs)
    long = next(r for r in result.records if r.prompt_len == 6000)
    kv_bytes_per_token = 32 * 8 * 128 * 2 * 2
    assert long.server_extra["kv_transfer_bytes"] == 5999 * kv_bytes_per_token
    assert long.server_extra["kv_transfer_ms"] > 0
    assert long.server_extra["prefill_ms"] < long.ttft * 1000
    stream_gaps = [g for r in result.records if r.prompt_len == 32 for g in r.itls[1:]]
    # The decode worker never prefills the long prompt: gaps stay near one decode step.
    assert max(stream_gaps) < 2 * min(stream_gaps)


def test_local_prefill_threshold_keeps_short_prompts_on_decode():
    specs = [SimRequestSpec("short", 0.0, 100, 4), SimRequestSpec("long", 0.0, 3000, 4)]
    result = simulate(
        make_config(Mode.DISAGG, router=RouterConfig((), (), local_prefill_threshold=1000)), specs
    )
    short, long = result.records
    assert "kv_transfer_bytes" not in short.server_extra
    assert "kv_transfer_bytes" in long.server_extra


def test_a_smaller_decode_budget_chunks_local_prefills():
    """Disagg with a local-prefill threshold: the decode worker prefills short prompts among
    its streams, each chunk one stall; its own smaller budget shortens the stalls."""
    specs = streams_plus_long_prompt(long_len=900)  # below the threshold: prefilled locally
    whole = make_config(
        Mode.DISAGG, router=RouterConfig((), (), local_prefill_threshold=1000), budget=1024
    )
    whole = replace(whole, pool=with_scheduler(whole.pool, long_prefill_token_threshold=None))
    chunked = replace(whole, pool=with_scheduler(whole.pool, max_num_batched_tokens=128))
    assert chunked.describe().endswith("local<1000 decode budget 128")

    def worst_stream_gap(config):
        records = simulate(config, specs).records
        return max(max(r.itls) for r in records if r.prompt_len == 32)

    assert worst_stream_gap(chunked) < 0.5 * worst_stream_gap(whole)


def test_concurrent_transfers_share_the_link():
    # Two prefill workers (one 8-GPU node each) send to one decode worker (a third node)
    # with one 25 GbE NIC: two equal transfers at once each take twice as long as one alone.
    config = make_config(Mode.DISAGG, tp=8, num_prefill=2, network=get_network("eth-25"))
    one = simulate(config, [SimRequestSpec("a", 0.0, 4000, 2)]).records[0]
    pair = simulate(
        config, [SimRequestSpec("a", 0.0, 4000, 2), SimRequestSpec("b", 0.0, 4000, 2)]
    ).records
    alone = one.server_extra["kv_transfer_ms"]
    shared = [r.server_extra["kv_transfer_ms"] for r in pair]
    assert alone == pytest.approx(3999 * 131_072 / (25e9 / 8 * 0.9) * 1000, rel=0.01)
    assert min(shared) == pytest.approx(2 * alone, rel=0.01)


def test_router_policies_spread_load():
    specs = [SimRequestSpec(str(i), 0.0, 500, 50) for i in range(8)]
    sim = Simulation(
        make_config(num_workers=4, router=RouterConfig((), (), decode_policy="round_robin")), specs
    )
    sim.run()
    assert [w.stats.num_steps > 0 for w in sim.main.workers] == [True] * 4


def test_step_jitter_is_reproducible_per_seed():
    jittery = Efficiency(step_jitter=(0.8, 1.0, 1.5), jitter_step_s=0.05)
    specs = poisson_specs(40, 20.0, seed=1)

    def timelines(**kwargs):
        return _timelines(simulate(make_config(Mode.CHUNKED, **kwargs), specs))

    steady = timelines(efficiency=replace(jittery, step_jitter=()))
    first = timelines(efficiency=jittery, seed=3)
    assert first == timelines(efficiency=jittery, seed=3)
    assert first != timelines(efficiency=jittery, seed=4)
    assert first != steady


def test_a_streamed_hand_off_exposes_only_what_the_link_cannot_hide():
    """A 100 Gb/s link between two 8-GPU nodes: the pulled KV's whole transfer follows the
    prefill; streamed, the link carries the chunks while the later ones compute and only the
    rest lands on the TTFT (`sim/handoff.py`)."""
    specs = [SimRequestSpec("long", 0.0, 8000, 2)]
    pulled = make_config(Mode.DISAGG, tp=8, network=get_network("100"))
    streamed = replace(pulled, router=replace(pulled.router, kv_handoff=KVHandoff.STREAM))
    pull, stream = (simulate(c, specs).records[0] for c in (pulled, streamed))
    assert stream.server_extra["prefill_ms"] == pytest.approx(pull.server_extra["prefill_ms"])
    assert stream.server_extra["kv_transfer_ms"] < 0.5 * pull.server_extra["kv_transfer_ms"]
    # The link is faster than the KV is made: only the last of the 16 chunks is exposed.
    last_chunk_ms = pull.server_extra["kv_transfer_ms"] / 16
    assert stream.server_extra["kv_transfer_ms"] == pytest.approx(last_chunk_ms, rel=0.05)
    assert stream.ttft < pull.ttft


def test_the_exposed_part_is_the_last_chunk_or_what_the_link_fell_behind():
    # A link faster than the KV is made: only the last chunk's own transfer is exposed.
    assert exposed_seconds(8e6, 1e9, 1.0, 8, is_streamed=True) == pytest.approx(1e-3)
    # A slow one: 8 MB take 8 s, 7/8 s of them hidden behind the later chunks.
    assert exposed_seconds(8e6, 1e6, 1.0, 8, is_streamed=True) == pytest.approx(8 - 7 / 8)
    assert exposed_seconds(8e6, 1e6, 1.0, 8, is_streamed=False) == pytest.approx(8)
    ttft = predicted_ttft(1.0, 8e6, 1e9, 8)
    assert ttft["alone"] < ttft["stream"] < ttft["pull"]


def test_an_idle_worker_gathers_a_burst_into_one_prefill_step():
    """As the engine loop does: requests 5 ms apart at an idle worker share its first step
    (one first token time for all), where without the gap the first started alone and its
    stream waited for the others' prefill."""
    specs = [SimRequestSpec(str(i), 0.005 * i, 64, 8) for i in range(4)]
    gathered = simulate(make_config(), specs)
    firsts = {r.token_times[0] for r in gathered.records}
    assert len(firsts) == 1
    assert min(firsts) >= 0.015 + make_config().burst_gap_s  # the last came at 15 ms
    alone = simulate(make_config(burst_gap_s=0.0), specs)
    assert alone.records[0].token_times[0] < min(firsts)
    # The first stream's second token waited for the other prompts' step.
    first_gap = alone.records[0].token_times[1] - alone.records[0].token_times[0]
    gathered_gap = gathered.records[0].token_times[1] - gathered.records[0].token_times[0]
    assert first_gap > gathered_gap


def test_a_gathering_ends_after_five_gaps_or_a_full_step():
    gap = make_config().burst_gap_s
    trickle = [SimRequestSpec(str(i), 0.5 * gap * i, 64, 2) for i in range(40)]
    result = simulate(make_config(), trickle)
    assert min(r.token_times[0] for r in result.records) < 6 * gap
    # Seats full: 4 prompts at once fill a worker of 4 seats, which starts at once.
    seats = make_config(max_num_seqs=4)
    burst = [SimRequestSpec(str(i), 0.0, 64, 2) for i in range(4)]
    assert max(r.token_times[0] for r in simulate(seats, burst).records) < gap


def test_a_decode_leg_is_not_held_for_a_burst():
    """Its prompt was prefilled elsewhere: the decode worker steps as its KV lands. (A prompt
    under the step budget: one that fills a step starts at once.)"""
    specs = [SimRequestSpec("0", 0.0, 1024, 4)]
    with_gap = simulate(make_config(Mode.DISAGG, budget=2048), specs).records[0]
    no_gap = simulate(make_config(Mode.DISAGG, budget=2048, burst_gap_s=0.0), specs).records[0]
    assert "prefill_ms" in with_gap.server_extra  # it went through the prefill pool
    # The prefill worker waited one gap; the decode worker none.
    gap = make_config().burst_gap_s
    assert with_gap.token_times[-1] - no_gap.token_times[-1] == pytest.approx(gap, abs=1e-9)
