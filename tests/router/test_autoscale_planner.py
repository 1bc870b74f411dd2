"""The autoscaler's decisions on synthetic metric series (no processes, no clock)."""

from __future__ import annotations

import itertools
import math

import pytest
from prometheus_client.exposition import generate_latest

from pdserve.api.metric_names import ITL_HISTOGRAM, TTFT_HISTOGRAM
from pdserve.core.scheduler import EngineStats
from pdserve.router.autoscale import planner
from pdserve.router.autoscale.config import SLO, AutoscaleConfig
from pdserve.router.autoscale.histogram import Histogram, HistogramRecorder
from pdserve.router.autoscale.planner import Action, AutoscaleController, Pressure
from pdserve.router.autoscale.signals import WorkerSample
from pdserve.router.health import parse_histogram
from pdserve.router.policies import PoolRole
from pdserve.server.metrics import ServerMetrics

PREFILL, DECODE = PoolRole.PREFILL, PoolRole.DECODE
BOUNDS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SLOW_TTFT = [3.0] * 10  # far over a 1 s TTFT SLO
FAST_TTFT = [0.08] * 10
SLOW_ITL = [0.4] * 50  # over a 0.1 s ITL SLO
FAST_ITL = [0.03] * 50


def config(**changes) -> AutoscaleConfig:
    fields = dict(
        min_prefill_workers=0,
        max_prefill_workers=2,
        min_decode_workers=1,
        max_decode_workers=2,
        slo=SLO(ttft_s=1.0, itl_s=0.1),
        interval_s=1.0,
        scale_up_intervals=2,
        scale_down_intervals=3,
        grace_s=3.0,
    )
    return AutoscaleConfig(**{**fields, **changes})


class Fleet:
    """Workers whose cumulative histograms grow tick by tick, as their /metrics would."""

    def __init__(self, **workers: PoolRole) -> None:
        self.roles = dict(workers)
        self._ttft = {name: HistogramRecorder(BOUNDS) for name in workers}
        self._itl = {name: HistogramRecorder(BOUNDS) for name in workers}
        self._busy: dict[str, float] = {}

    def add(self, name: str, role: PoolRole) -> None:
        self.roles[name] = role
        self._ttft[name] = HistogramRecorder(BOUNDS)
        self._itl[name] = HistogramRecorder(BOUNDS)

    def samples(self, **observed: dict) -> list[WorkerSample]:
        """One tick (1 s): `observed[name]` = dict(ttft=[...], itl=[...], waiting=N, kv=F,
        running=N, busy=seconds busy in the tick)."""
        out = []
        for name, role in self.roles.items():
            seen = observed.get(name, {})
            self._busy[name] = self._busy.get(name, 0.0) + seen.get("busy", 0.0)
            for value in seen.get("ttft", ()):
                self._ttft[name].observe(value)
            for value in seen.get("itl", ()):
                self._itl[name].observe(value)
            out.append(
                WorkerSample(
                    name,
                    f"http://{name}",
                    role,
                    num_running=seen.get("running", 0),
                    num_waiting=seen.get("waiting", 0),
                    kv_cache_usage=seen.get("kv", 0.0),
                    busy_s=self._busy.setdefault(name, 0.0),
                    ttft=self._ttft[name].snapshot(),
                    itl=self._itl[name].snapshot(),
                )
            )
        return out


ROOM = {PREFILL: True, DECODE: True}
NO_ROOM = {PREFILL: False, DECODE: False}


def run(
    controller: AutoscaleController,
    fleet: Fleet,
    ticks: list[dict],
    can_start=ROOM,
    start: int = 0,
):
    """Feed one tick per entry (times start, start + 1, ...); returns {time: decision}."""
    decisions = {}
    for t, observed in enumerate(ticks, start):
        decision = controller.tick(float(t), fleet.samples(**observed), can_start)
        if decision is not None:
            decisions[t] = decision
    return decisions


def test_sustained_prefill_pressure_adds_a_prefill_worker():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [busy, busy])
    assert list(decisions) == [1]  # the second tick in a row, not the first
    decision = decisions[1]
    assert (decision.action, decision.role, decision.reason) == (Action.ADD, PREFILL, "ttft")
    assert decision.direction == "up" and "ttft p90" in decision.detail


def test_an_interval_without_a_first_token_neither_builds_nor_breaks_the_evidence():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    # Long prompts still computing: nothing to measure this interval, but work in flight.
    computing = {"p0": {"running": 1}, "d0": {"itl": FAST_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [busy, computing, busy])
    assert [(t, d.action) for t, d in decisions.items()] == [(2, Action.ADD)]
    # Nothing in flight and nothing measured is quiet, not missing news: it breaks the streak.
    idle = {"d0": {"itl": FAST_ITL}}
    assert (
        run(AutoscaleController(config()), Fleet(p0=PREFILL, d0=DECODE), [busy, idle, busy]) == {}
    )


def test_a_blip_changes_nothing():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    normal = {"p0": {"ttft": [0.7] * 10}, "d0": {"itl": [0.07] * 50}}
    blip = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": SLOW_ITL}}
    assert run(AutoscaleController(config()), fleet, [normal, blip, normal, blip, normal]) == {}


def test_a_queue_is_pressure_too():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    queued = {"p0": {"waiting": 5}, "d0": {"itl": FAST_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [queued, queued])
    assert (decisions[1].action, decisions[1].role, decisions[1].reason) == (
        Action.ADD,
        PREFILL,
        "queue",
    )


def test_decode_pressure_from_itl_or_a_full_kv_cache_adds_a_decode_worker():
    for observed, reason in (
        ({"itl": SLOW_ITL}, "itl"),
        ({"itl": FAST_ITL, "kv": 0.95}, "kv_cache"),
    ):
        fleet = Fleet(p0=PREFILL, d0=DECODE)
        busy = {"p0": {"ttft": [0.7] * 10}, "d0": observed}
        decisions = run(AutoscaleController(config()), fleet, [busy, busy])
        assert (decisions[1].action, decisions[1].role, decisions[1].reason) == (
            Action.ADD,
            DECODE,
            reason,
        )


def test_an_addition_is_sized_to_how_far_past_its_target_the_pool_is():
    """ceil(n * severity) - n workers at once, within --autoscale-max-step and the room."""
    slow = {"p0": {"ttft": [0.7] * 10}, "d0": {"itl": SLOW_ITL}, "d1": {"itl": SLOW_ITL}}
    mild = {"p0": {"ttft": [0.7] * 10}, "d0": {"itl": [0.15] * 50}, "d1": {"itl": [0.15] * 50}}

    def first_addition(observed: dict, **changes) -> planner.Decision:
        controller = AutoscaleController(config(**{"max_decode_workers": 64, **changes}))
        fleet = Fleet(p0=PREFILL, d0=DECODE, d1=DECODE)
        (decision,) = run(controller, fleet, [observed, observed]).values()
        assert (decision.action, decision.role) == (Action.ADD, DECODE)
        return decision

    # The default: one worker per addition, however far past.
    assert first_addition(slow).num_workers == 1
    # ITL p90 about 1.9x its SLO on two workers: two more.
    mild_step = first_addition(mild, max_step_workers=16)
    assert mild_step.num_workers == 2 and mild_step.describe().startswith("add 2 decode workers")
    # Far past: capped by the step, then by the pool's maximum and the fleet's room.
    assert first_addition(slow, max_step_workers=3).num_workers == 3
    assert first_addition(slow, max_step_workers=16, max_decode_workers=4).num_workers == 2
    assert first_addition(slow, max_step_workers=16, max_workers=4).num_workers == 1
    with pytest.raises(ValueError, match="max_step_workers"):
        config(max_step_workers=0)


def test_quiet_pools_shrink_to_their_minimum_one_worker_at_a_time():
    fleet = Fleet(p0=PREFILL, p1=PREFILL, d0=DECODE)
    quiet = {"p0": {"ttft": FAST_TTFT}, "p1": {}, "d0": {"itl": FAST_ITL}}
    controller = AutoscaleController(config(cooldown_s=0.0))
    decisions = run(controller, fleet, [quiet] * 3)
    assert list(decisions) == [2]  # after scale_down_intervals quiet ticks
    decision = decisions[2]
    assert (decision.action, decision.role, decision.worker_id) == (Action.REMOVE, PREFILL, "p1")
    assert decision.direction == "down" and decision.reason == "idle"
    # The next removal needs quiet ticks of its own; then the pools are at their minima.
    del fleet.roles["p1"]
    quiet.pop("p1")
    decisions = run(controller, fleet, [quiet] * 3, start=3)
    assert [(t, d.action, d.worker_id) for t, d in decisions.items()] == [(5, Action.REMOVE, "p0")]
    del fleet.roles["p0"]
    quiet.pop("p0")
    assert run(controller, fleet, [quiet] * 10, start=6) == {}


def test_a_busy_prefill_pool_is_not_quiet_however_fast_its_prompts():
    # Prompts answered well within the SLO, but the workers are busy most of the time: one
    # less would queue them.
    fleet = Fleet(p0=PREFILL, p1=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": FAST_TTFT, "busy": 0.7}, "p1": {"busy": 0.5}, "d0": {"itl": FAST_ITL}}
    assert run(AutoscaleController(config()), fleet, [busy] * 8) == {}
    # The last prefill worker goes only if its prompts would take at most a fifth of each
    # decode worker's time there.
    for busy_s, expected in ((0.5, {}), (0.15, {Action.REMOVE})):
        fleet = Fleet(p0=PREFILL, d0=DECODE)
        lone = {"p0": {"ttft": FAST_TTFT, "busy": busy_s}, "d0": {"itl": FAST_ITL}}
        decisions = run(AutoscaleController(config()), fleet, [lone] * 8)
        assert {d.action for d in decisions.values()} == (expected or set())


def test_a_decode_pool_whose_load_would_not_fit_one_worker_less_is_not_quiet():
    fleet = Fleet(p0=PREFILL, d0=DECODE, d1=DECODE)
    half_full = {"p0": {"ttft": [0.7] * 10}, "d0": {"itl": FAST_ITL, "kv": 0.4}, "d1": {"kv": 0.4}}
    assert run(AutoscaleController(config()), fleet, [half_full] * 6) == {}


def test_after_adding_a_worker_nothing_changes_for_the_grace_period():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    controller = AutoscaleController(config(max_prefill_workers=3, grace_s=3.0))
    decisions = run(controller, fleet, [busy] * 2)
    assert list(decisions) == [1]
    fleet.add("p1", PREFILL)
    busy["p1"] = {"ttft": SLOW_TTFT}
    # Ticks 2 and 3 fall within the grace period (added at 1, for 3 s); the pressure must
    # then hold for two ticks again (4 and 5) before the next addition.
    later = run(controller, fleet, [busy] * 5, start=2)
    assert [(t, d.action) for t, d in later.items()] == [(5, Action.ADD)]


def test_at_most_one_change_per_cooldown_under_steady_pressure_on_both_pools():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": SLOW_ITL}}
    controller = AutoscaleController(
        config(max_prefill_workers=9, max_decode_workers=9, grace_s=0.0, cooldown_s=2.5)
    )
    decisions = run(controller, fleet, [busy] * 20)
    times = sorted(decisions)
    assert len(times) >= 3
    assert all(b - a >= 2.5 for a, b in itertools.pairwise(times))


def test_the_pools_bounds_and_the_room_left_are_respected():
    fleet = Fleet(p0=PREFILL, p1=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": SLOW_TTFT}, "p1": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    assert run(AutoscaleController(config(max_prefill_workers=2)), fleet, [busy] * 5) == {}
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    busy = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": [0.07] * 50}}
    assert run(AutoscaleController(config()), fleet, [busy] * 5, can_start=NO_ROOM) == {}
    assert run(AutoscaleController(config(max_workers=2)), fleet, [busy] * 5) == {}
    # At the minimum, quiet forever changes nothing.
    fleet = Fleet(d0=DECODE)
    quiet = {"d0": {"itl": FAST_ITL}}
    assert run(AutoscaleController(config()), fleet, [quiet] * 10) == {}
    with pytest.raises(ValueError, match="min-decode-workers"):
        config(min_decode_workers=0)
    with pytest.raises(ValueError, match="min-prefill-workers"):
        config(min_prefill_workers=3, max_prefill_workers=2)


def test_a_saturated_pool_takes_a_worker_of_an_idle_pool():
    # Decode saturated, the only prefill worker idle: it switches (min prefill is 0).
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    shift = {"p0": {"ttft": FAST_TTFT}, "d0": {"itl": SLOW_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [shift] * 2, can_start=NO_ROOM)
    decision = decisions[1]
    assert (decision.action, decision.role, decision.worker_id) == (Action.SWITCH, DECODE, "p0")
    assert decision.direction == "switch" and decision.reason == "itl"
    # Switching is preferred to adding when the other pool is idle, even with room.
    assert run(AutoscaleController(config()), fleet, [shift] * 2)[1].action is Action.SWITCH
    # Prefill saturated, one of two decode workers idle: the newest idle one switches.
    fleet = Fleet(p0=PREFILL, d0=DECODE, d1=DECODE)
    shift = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL, "running": 1}, "d1": {}}
    decision = run(AutoscaleController(config()), fleet, [shift] * 2, can_start=NO_ROOM)[1]
    assert (decision.action, decision.role, decision.worker_id) == (Action.SWITCH, PREFILL, "d1")
    # Never the last decode worker, and not when switching is off.
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    shift = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    one_decode = config(max_decode_workers=1)
    assert run(AutoscaleController(one_decode), fleet, [shift] * 4, can_start=NO_ROOM) == {}
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    shift = {"p0": {"ttft": FAST_TTFT}, "d0": {"itl": SLOW_ITL}}
    decisions = run(AutoscaleController(config(allow_role_switch=False)), fleet, [shift] * 2)
    assert decisions[1].action is Action.ADD


def test_at_the_limit_a_pressed_pool_takes_a_worker_a_comfortable_pool_can_spare():
    """Four prefill workers half busy are not idle (no `switch_in`), but three carry their
    load: at the fleet's limit the pressed decode pool gets one. At 70% busy they cannot."""
    wide = config(max_prefill_workers=8, max_decode_workers=8)

    def decisions(busy: float) -> dict:
        fleet = Fleet(p0=PREFILL, p1=PREFILL, p2=PREFILL, p3=PREFILL, d0=DECODE)
        prefill = {"ttft": FAST_TTFT, "busy": busy}
        tick = {**{f"p{i}": prefill for i in range(4)}, "d0": {"itl": SLOW_ITL}}
        return run(AutoscaleController(wide), fleet, [tick] * 4, can_start=NO_ROOM)

    [(_, decision)] = decisions(0.5).items()
    assert (decision.action, decision.role) == (Action.SWITCH, DECODE)
    assert "prefill pool can spare a worker" in decision.detail
    assert decisions(0.7) == {}
    # With room, a new worker comes first.
    fleet = Fleet(p0=PREFILL, p1=PREFILL, p2=PREFILL, p3=PREFILL, d0=DECODE)
    tick = {**{f"p{i}": {"ttft": FAST_TTFT, "busy": 0.5} for i in range(4)}}
    tick["d0"] = {"itl": SLOW_ITL}
    assert run(AutoscaleController(wide), fleet, [tick] * 2)[1].action is Action.ADD


def test_without_prefill_workers_the_decode_workers_ttft_is_the_prefill_demand():
    fleet = Fleet(d0=DECODE, d1=DECODE)
    long_prompts = {"d0": {"ttft": SLOW_TTFT, "itl": FAST_ITL}, "d1": {"itl": FAST_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [long_prompts] * 2)
    assert (decisions[1].action, decisions[1].role, decisions[1].reason) == (
        Action.ADD,
        PREFILL,
        "ttft",
    )
    # Without room, a decode worker does not turn prefill worker for TTFT's sake: both decode
    # workers prefill already, one on prefill alone would do less of it. Nor is the decode
    # pool idle (to be drained) while its prompts wait.
    assert run(AutoscaleController(config()), fleet, [long_prompts] * 8, can_start=NO_ROOM) == {}


def test_a_lone_saturated_prefill_worker_merges_into_an_idle_decode_pool():
    """1 + 1 at the limit, prompts piling up, decode idle: 0 + 2, both prefilling."""
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    long_prompts = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [long_prompts] * 2, can_start=NO_ROOM)
    decision = decisions[1]
    assert (decision.action, decision.role, decision.worker_id, decision.reason) == (
        Action.SWITCH,
        DECODE,
        "p0",
        "ttft",
    )
    assert "decode pool idle" in decision.detail
    # Not when the prefill pool's minimum is one worker.
    keep_one = config(min_prefill_workers=1)
    assert run(AutoscaleController(keep_one), fleet, [long_prompts] * 4, can_start=NO_ROOM) == {}


def test_decode_workers_stalled_by_their_own_prefills_split_off_a_prefill_worker():
    """0 + 2 at the limit, ITL over the SLO: one of them takes every prefill (1 + 1)."""
    fleet = Fleet(d0=DECODE, d1=DECODE)
    stalled = {"d0": {"itl": SLOW_ITL, "running": 2}, "d1": {"itl": SLOW_ITL}}
    decisions = run(AutoscaleController(config()), fleet, [stalled] * 2, can_start=NO_ROOM)
    decision = decisions[1]
    assert (decision.action, decision.role, decision.worker_id, decision.reason) == (
        Action.SWITCH,
        PREFILL,
        "d1",
        "itl",
    )
    # A full KV cache is decode load, not stalls: no split for that.
    full = {"d0": {"itl": FAST_ITL, "kv": 0.95}, "d1": {"itl": FAST_ITL, "kv": 0.95}}
    assert run(AutoscaleController(config()), fleet, [full] * 4, can_start=NO_ROOM) == {}


def test_a_switch_is_undone_soon_only_on_much_stronger_evidence():
    """Neither 1 + 1 (prefill saturated) nor 0 + 2 (streams stalled) meets the SLOs: the
    planner keeps the layout whose miss is smaller instead of flapping."""
    controller = AutoscaleController(config(grace_s=2.0))
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    merge = run(controller, fleet, [{"p0": {"ttft": [1.5] * 10}, "d0": {}}] * 2, NO_ROOM)
    assert merge[1].action is Action.SWITCH and merge[1].role is DECODE  # severity 1.5
    fleet.roles["p0"] = DECODE
    # ITL 0.12 s over 0.1 s (severity ~1.2 < 2 x 1.5): kept, however long it lasts...
    mild = {"p0": {"itl": [0.12] * 50}, "d0": {"itl": [0.12] * 50}}
    assert run(controller, fleet, [mild] * 8, NO_ROOM, start=2) == {}
    # ...and a much worse miss (ITL 0.4 s: severity 4) undoes it.
    bad = {"p0": {"itl": SLOW_ITL}, "d0": {"itl": SLOW_ITL}}
    split = run(controller, fleet, [bad] * 2, NO_ROOM, start=10)
    assert [(d.action, d.role) for d in split.values()] == [(Action.SWITCH, PREFILL)]


def test_the_tick_log_records_each_pools_signals():
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    controller = AutoscaleController(config())
    run(controller, fleet, [{"p0": {"ttft": SLOW_TTFT, "waiting": 3}, "d0": {"kv": 0.25}}])
    (tick,) = controller.ticks
    logged = tick.to_dict()
    assert logged["signals"]["prefill"]["num_waiting"] == 3
    assert logged["signals"]["prefill"]["ttft_p90_ms"] > 2000
    assert logged["signals"]["decode"]["kv_cache_usage"] == 0.25
    assert logged["signals"]["decode"]["itl_p90_ms"] is None
    assert logged["decision"] is None


def test_a_long_running_controller_keeps_only_the_latest_ticks_and_decisions(monkeypatch):
    monkeypatch.setattr(planner, "MAX_TICKS", 4)
    monkeypatch.setattr(planner, "MAX_DECISIONS", 1)
    fleet = Fleet(p0=PREFILL, d0=DECODE)
    controller = AutoscaleController(config(grace_s=0.0, cooldown_s=0.0, max_prefill_workers=9))
    slow = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}}
    made = run(controller, fleet, [slow] * 10)
    assert len(made) > 1  # a new worker every other tick
    assert [t.time_s for t in controller.ticks] == [6.0, 7.0, 8.0, 9.0]
    assert list(controller.decisions) == [made[max(made)]]


def test_the_rules_are_tried_in_order_on_the_pressed_pools_then_the_quiet_ones():
    assert [(rule.name, rule.streak) for rule in planner.RULES] == [
        ("switch_in", Pressure.HIGH),
        ("add", Pressure.HIGH),
        ("rebalance", Pressure.HIGH),
        ("merge", Pressure.HIGH),
        ("split", Pressure.HIGH),
        ("drain", Pressure.LOW),
    ]


# ---- histograms ------------------------------------------------------------------------
def test_windowed_quantiles_follow_histogram_quantile():
    recorder = HistogramRecorder(BOUNDS)
    for value in [0.07] * 9 + [3.0]:
        recorder.observe(value)
    first = recorder.snapshot()
    assert first.count == 10
    # rank 9 of 10 falls at the top of the (0.05, 0.1] bucket
    assert first.quantile(0.9) == pytest.approx(0.1)
    for value in [0.3] * 10:
        recorder.observe(value)
    window = recorder.snapshot().minus(first)
    assert window.count == 10 and 0.2 < window.quantile(0.9) <= 0.5
    assert Histogram().quantile(0.9) is None
    # A restarted worker's counters went down: the whole histogram is the window.
    assert first.minus(recorder.snapshot()) == first
    over = HistogramRecorder(BOUNDS)
    over.observe(60.0)
    assert over.snapshot().quantile(0.5) == BOUNDS[-1]


def test_a_workers_exported_histograms_parse_back_exactly():
    metrics = ServerMetrics("m", stats=EngineStats)
    recorder = None
    for value in (0.004, 0.03, 0.03, 0.2, 1.7, 400.0):
        metrics.time_to_first_token.observe(value)
        metrics.inter_token_latency.observe(value / 10)
    text = generate_latest(metrics.registry).decode()
    ttft, itl = parse_histogram(text, TTFT_HISTOGRAM), parse_histogram(text, ITL_HISTOGRAM)
    assert ttft.count == itl.count == 6
    assert math.isinf(ttft.bounds[-1])
    recorder = HistogramRecorder(ttft.bounds[:-1])
    for value in (0.004, 0.03, 0.03, 0.2, 1.7, 400.0):
        recorder.observe(value)
    assert recorder.snapshot() == ttft
    assert parse_histogram(text, "pdserve:no_such_histogram") == Histogram()


def test_slo_parsing_names_the_flag():
    assert SLO.parse("ttft:500,itl:50") == SLO(0.5, 0.05)
    assert SLO.parse("itl:20") == SLO(None, 0.02)
    assert SLO.parse(None) == SLO()
    for bad in ("tpot:50", "ttft", "ttft:fast", "ttft:-1"):
        with pytest.raises(ValueError, match="--slo"):
            SLO.parse(bad)


def test_a_replayed_decision_waits_for_its_time_and_takes_a_worker_still_there():
    decisions = [
        planner.Decision(1.5, Action.REMOVE, DECODE, "idle", "quiet", worker_id="decode-9"),
        planner.Decision(2.0, Action.ADD, PREFILL, "ttft", "slow", num_workers=2),
    ]
    replayed = [planner.Decision.from_dict(d.to_dict()) for d in decisions]
    assert replayed == decisions
    controller = AutoscaleController(config(), replay=replayed)
    fleet = Fleet(p0=PREFILL, d0=DECODE, d1=DECODE)
    # However slow the prefills, nothing happens before the first decision's time.
    slow = {"p0": {"ttft": SLOW_TTFT}, "d0": {"itl": FAST_ITL}, "d1": {"running": 3}}
    made = run(controller, fleet, [slow, slow, slow, slow])
    assert list(made) == [2, 3]
    # decode-9 is gone: the least loaded decode worker goes instead.
    assert (made[2].action, made[2].worker_id, made[2].time_s) == (Action.REMOVE, "d0", 2.0)
    assert (made[3].action, made[3].num_workers) == (Action.ADD, 2)
    assert list(controller.decisions) == [made[2], made[3]]
