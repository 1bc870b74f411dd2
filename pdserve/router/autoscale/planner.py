"""The planner: each pool's pressure, and the change to make. Pure Python: signals in,
decisions out (no clock, no I/O, no torch).

Each tick (every `interval_s`):
1. `signals.fleet_signals`: each pool's signals over the interval.
2. Each pool's `Pressure` (`assess`): HIGH (prefill: TTFT p90 over the SLO, a queue, or too
   many pending prompt tokens; decode: ITL p90 over the SLO, a queue, or the KV cache nearly
   full), LOW (p90 well under the SLO, nothing queued, and the load fits on one worker less)
   or NORMAL. Hysteresis: HIGH counts after `scale_up_intervals` ticks in a row, LOW after
   `scale_down_intervals`.
3. At most one change per tick, none within `cooldown_s` of the previous one or `grace_s` of
   an addition (the new worker has to show its effect first, as NVIDIA Dynamo's SLA planner
   waits), and the evidence starts afresh after each change. The change is the first of
   `RULES` that applies, tried on the HIGH pools (the most pressed first), then on the LOW
   ones (the longest quiet first):
   - `switch_in`: a HIGH pool below its maximum takes a worker of the other pool when that
     one is LOW and above its minimum (a role switch: no weights loaded, no core added);
   - `add`: else it gets a new worker when there is room (`max_workers`, and the
     provisioner's `can_start`);
   - `rebalance`: at the limit, a worker of the other pool when that one can spare it (its
     load fits on one worker less under `spare_fraction`, nothing queued, p90 well under
     its SLO): a large fleet's pools are rarely idle, only comfortable;
   - at the limit, small fleets rebalance by switching: `merge`, a lone prefill worker that
     cannot keep up while the decode pool idles becomes a decode worker (every decode worker
     then prefills its own prompts), and `split`, without a prefill pool, decode workers whose
     ITL suffers give one of themselves to prefill (the others stop stalling on prefills);
   - `drain`: a LOW pool above its minimum drains one worker (removal always drains first).
   A switch, like an addition, is followed by the grace period, and undoing it within
   `grace_s + REVERSAL_INTERVALS * interval_s` takes evidence `REVERSAL_MARGIN` times as
   strong as what decided it (so a fleet where no layout meets the SLOs does not flap).

A long-running router keeps only the latest `MAX_TICKS` ticks and `MAX_DECISIONS` decisions.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.autoscale.signals import PoolSignals, WorkerSample, fleet_signals
from pdserve.router.policies import PoolRole

OTHER_ROLE = {PoolRole.PREFILL: PoolRole.DECODE, PoolRole.DECODE: PoolRole.PREFILL}
# How much stronger the evidence must be to undo a switch, within the grace period plus this
# many intervals of it.
REVERSAL_MARGIN = 2.0
REVERSAL_INTERVALS = 10
# History a controller keeps (a day of ticks at the default 10 s interval).
MAX_TICKS = 8640
MAX_DECISIONS = 1024


class Pressure(enum.Enum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


class Action(enum.Enum):
    ADD = "add"
    REMOVE = "remove"
    SWITCH = "switch"


_DIRECTION = {Action.ADD: "up", Action.REMOVE: "down", Action.SWITCH: "switch"}


@dataclass(frozen=True)
class Assessment:
    """One pool's pressure now; `reason` is a short label (metrics), `detail` for people."""

    pressure: Pressure
    reason: str = ""
    detail: str = ""
    # How far past its target the pool is (the larger HIGH pool is served first).
    severity: float = 0.0
    # False when the interval says nothing: work in flight, but none of it reached a first
    # token (prefill) or a next token (decode) to measure. The streaks then stay as they are.
    is_news: bool = True


@dataclass(frozen=True)
class Decision:
    """One change. `role` is the pool that gains a worker (add, switch: it comes from the
    other pool) or loses one (remove); `worker_id` is the worker removed or switched;
    `num_workers` the workers an addition starts (1 for the others)."""

    time_s: float
    action: Action
    role: PoolRole
    reason: str
    detail: str
    worker_id: str | None = None
    num_workers: int = 1

    @property
    def direction(self) -> str:
        return _DIRECTION[self.action]

    def describe(self) -> str:
        if self.action is Action.ADD and self.num_workers > 1:
            what = f"add {self.num_workers} {self.role.value} workers"
        elif self.action is Action.ADD:
            what = f"add a {self.role.value} worker"
        elif self.action is Action.REMOVE:
            what = f"drain {self.role.value} worker {self.worker_id}"
        else:
            what = f"switch {self.worker_id} to {self.role.value}"
        return f"{what}: {self.detail}"

    @classmethod
    def from_dict(cls, data: Mapping) -> Decision:
        """The inverse of `to_dict` (a live router's GET /autoscale, a saved result)."""
        return cls(
            time_s=float(data["time_s"]),
            action=Action(data["action"]),
            role=PoolRole(data["role"]),
            reason=data.get("reason", ""),
            detail=data.get("detail", ""),
            worker_id=data.get("worker_id"),
            num_workers=int(data.get("num_workers", 1)),
        )

    def to_dict(self) -> dict:
        return {
            "time_s": round(self.time_s, 3),
            "action": self.action.value,
            "role": self.role.value,
            "direction": self.direction,
            "reason": self.reason,
            "detail": self.detail,
            "worker_id": self.worker_id,
            "num_workers": self.num_workers,
        }


def assess(role: PoolRole, signals: PoolSignals, config: AutoscaleConfig) -> Assessment:
    """HIGH on the first target missed; LOW when every signal is comfortably quiet."""
    n = signals.num_workers
    per_worker = max(n, 1)
    slo = config.slo
    target, p90, name = (
        (slo.ttft_s, signals.ttft_p90_s, "ttft")
        if role is PoolRole.PREFILL
        else (slo.itl_s, signals.itl_p90_s, "itl")
    )
    checks = [(name, p90, target, f"{name} p90 {_fmt_s(p90)} > SLO {_fmt_s(target)}")]
    waiting = signals.num_waiting / per_worker
    checks.append(("queue", waiting, config.queue_high, f"{waiting:.1f} waiting per worker"))
    if role is PoolRole.PREFILL and config.prefill_tokens_high is not None:
        tokens = signals.num_pending_prompt_tokens / per_worker
        checks.append(
            ("prompt_tokens", tokens, config.prefill_tokens_high, f"{tokens:.0f} prompt tokens")
        )
    if role is PoolRole.DECODE and n:
        usage = signals.kv_cache_usage / n
        checks.append(("kv_cache", usage, config.kv_high, f"KV cache {usage:.0%} used"))
    misses = [
        (value / limit, reason, detail)
        for reason, value, limit, detail in checks
        if value is not None and limit is not None and value > limit
    ]
    if misses:
        severity, reason, detail = max(misses)
        return Assessment(Pressure.HIGH, reason, detail, severity)
    in_flight = signals.num_running + signals.num_waiting + signals.num_pending_prompt_tokens
    if p90 is None and target is not None and in_flight:
        return Assessment(Pressure.NORMAL, is_news=False)
    if n and is_quiet(role, signals, config):
        return Assessment(Pressure.LOW, "idle", f"quiet ({name} p90 {_fmt_s(p90)})")
    return Assessment(Pressure.NORMAL)


def is_quiet(role: PoolRole, signals: PoolSignals, config: AutoscaleConfig) -> bool:
    """Nothing queued, the p90 well under its SLO, and the load would fit on one worker
    less: the KV in use (decode), the busy time (prefill; a lone prefill worker: mostly
    idle)."""
    n = signals.num_workers
    if not _is_comfortable(role, signals, config):
        return False
    if role is PoolRole.DECODE and n > 1:
        return signals.kv_cache_usage / (n - 1) <= config.kv_low
    if role is PoolRole.PREFILL and n:
        return signals.utilization / max(n - 1, 1) <= config.utilization_low
    return True


def can_spare(role: PoolRole, signals: PoolSignals, config: AutoscaleConfig) -> bool:
    """`role`'s pool would carry its load on one worker less: comfortable now, and that load
    (prefill: busy time; decode: KV in use) under `spare_fraction` on the others."""
    n = signals.num_workers
    load = signals.utilization if role is PoolRole.PREFILL else signals.kv_cache_usage
    return (
        n >= 2
        and _is_comfortable(role, signals, config)
        and load / (n - 1) <= config.spare_fraction
    )


def _is_comfortable(role: PoolRole, signals: PoolSignals, config: AutoscaleConfig) -> bool:
    """Nothing queued and the p90 well under its SLO (or nothing to measure)."""
    target, p90 = (
        (config.slo.ttft_s, signals.ttft_p90_s)
        if role is PoolRole.PREFILL
        else (config.slo.itl_s, signals.itl_p90_s)
    )
    return signals.num_waiting == 0 and (
        p90 is None or target is None or p90 <= config.low_fraction * target
    )


# (what to do, the pool that gains a worker or loses one, the evidence)
Change = tuple[Action, PoolRole, Assessment]


@dataclass(frozen=True)
class Situation:
    """What a rule sees at one tick."""

    now: float
    signals: Mapping[PoolRole, PoolSignals]
    assessments: Mapping[PoolRole, Assessment]
    can_start: Mapping[PoolRole, bool]
    has_room: bool  # fewer workers than `max_workers`

    def counts(self, role: PoolRole) -> tuple[int, int]:
        """Workers of `role`'s pool and of the other pool."""
        return self.signals[role].num_workers, self.signals[OTHER_ROLE[role]].num_workers


@dataclass(frozen=True)
class Rule:
    """One way to relieve a pool: tried on pools whose `streak` pressure lasted (HIGH:
    `scale_up_intervals` ticks, LOW: `scale_down_intervals`); the change, or None."""

    name: str
    streak: Pressure
    apply: Callable[[Planner, Situation, PoolRole], Change | None]


def _switch_in(planner: Planner, seen: Situation, role: PoolRole) -> Change | None:
    """A worker of the idle other pool. Not into an empty prefill pool: the decode workers
    there all prefill already, and one of them on prefill alone would have less room for
    it, not more."""
    config, other = planner.config, OTHER_ROLE[role]
    num, num_other = seen.counts(role)
    if (
        num < config.bounds(role)[1]
        and config.allow_role_switch
        and planner.is_idle(other)
        and num_other > config.bounds(other)[0]
        and not (role is PoolRole.PREFILL and num == 0)
        and planner.may_switch_into(role, seen.assessments[role].severity, seen.now)
    ):
        return Action.SWITCH, role, seen.assessments[role]
    return None


def _add(planner: Planner, seen: Situation, role: PoolRole) -> Change | None:
    """A new worker, where there is room."""
    if (
        seen.counts(role)[0] < planner.config.bounds(role)[1]
        and seen.has_room
        and seen.can_start.get(role, False)
    ):
        return Action.ADD, role, seen.assessments[role]
    return None


def _rebalance(planner: Planner, seen: Situation, role: PoolRole) -> Change | None:
    """At the fleet's limit, a worker of the other pool when that pool can spare one
    (`can_spare`): `switch_in` for a large pool that is comfortable rather than idle, which
    a large fleet rarely is. Fleets of one worker per pool never take this way."""
    config, other = planner.config, OTHER_ROLE[role]
    num, num_other = seen.counts(role)
    evidence = seen.assessments[role]
    if (
        not (seen.has_room and seen.can_start.get(role, False))
        and num < config.bounds(role)[1]
        and config.allow_role_switch
        and num_other > config.bounds(other)[0]
        and seen.assessments[other].pressure is not Pressure.HIGH
        and can_spare(other, seen.signals[other], config)
        and not (role is PoolRole.PREFILL and num == 0)
        and planner.may_switch_into(role, evidence.severity, seen.now)
    ):
        detail = f"{evidence.detail}; the {other.value} pool can spare a worker"
        return Action.SWITCH, role, replace(evidence, detail=detail)
    return None


def _merge(planner: Planner, seen: Situation, role: PoolRole) -> Change | None:
    """A lone prefill worker cannot keep up while the decode pool idles at its minimum. As a
    decode worker it adds its core to the idle ones, and every decode worker prefills its
    own prompts."""
    config = planner.config
    num, num_other = seen.counts(role)
    evidence = seen.assessments[role]
    if (
        config.allow_role_switch
        and role is PoolRole.PREFILL
        and num == 1 > config.bounds(PoolRole.PREFILL)[0]
        and planner.is_idle(PoolRole.DECODE)
        and num_other < config.bounds(PoolRole.DECODE)[1]
        and planner.may_switch_into(PoolRole.DECODE, evidence.severity, seen.now)
    ):
        detail = f"{evidence.detail}; decode pool idle: it takes the prefills"
        return Action.SWITCH, PoolRole.DECODE, replace(evidence, detail=detail)
    return None


def _split(planner: Planner, seen: Situation, role: PoolRole) -> Change | None:
    """Decode workers that prefill their own prompts stall their streams; one of them takes
    every prefill so the others stream undisturbed."""
    config = planner.config
    num, num_prefill = seen.counts(role)
    evidence = seen.assessments[role]
    if (
        config.allow_role_switch
        and role is PoolRole.DECODE
        and num_prefill == 0
        and evidence.reason == "itl"
        and num > config.bounds(PoolRole.DECODE)[0]
        and config.bounds(PoolRole.PREFILL)[1] >= 1
        and planner.may_switch_into(PoolRole.PREFILL, evidence.severity, seen.now)
    ):
        detail = f"{evidence.detail}; local prefills stall the streams"
        return Action.SWITCH, PoolRole.PREFILL, replace(evidence, detail=detail)
    return None


def _drain(planner: Planner, seen: Situation, role: PoolRole) -> Change | None:
    """One worker of a quiet pool above its minimum; the last prefill worker only if its
    prompts fit the decode workers' share (`local_prefill_share`)."""
    config = planner.config
    if seen.counts(role)[0] <= config.bounds(role)[0]:
        return None
    prefill = seen.signals[PoolRole.PREFILL]
    if role is PoolRole.PREFILL and prefill.num_workers <= 1:
        num_decode = seen.signals[PoolRole.DECODE].num_workers
        if prefill.utilization > config.local_prefill_share * num_decode:
            return None
    return Action.REMOVE, role, seen.assessments[role]


# In the order they are tried on each pool (module docstring).
RULES = (
    Rule("switch_in", Pressure.HIGH, _switch_in),
    Rule("add", Pressure.HIGH, _add),
    Rule("rebalance", Pressure.HIGH, _rebalance),
    Rule("merge", Pressure.HIGH, _merge),
    Rule("split", Pressure.HIGH, _split),
    Rule("drain", Pressure.LOW, _drain),
)


class Planner:
    """Hysteresis, cooldown and bounds over `assess`, then `RULES` (module docstring)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._high = dict.fromkeys(PoolRole, 0)
        self._low = dict.fromkeys(PoolRole, 0)
        self._hold_until = -math.inf
        # The latest switch: (when, the pool it fed, the severity that decided it).
        self._last_switch: tuple[float, PoolRole, float] | None = None

    def decide(
        self,
        now: float,
        signals: Mapping[PoolRole, PoolSignals],
        can_start: Mapping[PoolRole, bool],
    ) -> Change | None:
        """The change to make now, if any: (action, pool, the evidence)."""
        if now < self._hold_until:
            return None  # a change is settling: its effect has to show first
        assessments = {role: assess(role, signals[role], self.config) for role in PoolRole}
        prefill = signals[PoolRole.PREFILL]
        if (
            prefill.num_workers == 0
            and assessments[PoolRole.DECODE].pressure is Pressure.LOW
            and not is_quiet(PoolRole.PREFILL, prefill, self.config)
        ):
            # The decode workers prefill too: idle only if that demand is quiet as well.
            assessments[PoolRole.DECODE] = Assessment(Pressure.NORMAL)
        for role, assessment in assessments.items():
            if not assessment.is_news:
                continue
            is_high = assessment.pressure is Pressure.HIGH
            is_low = assessment.pressure is Pressure.LOW
            self._high[role] = self._high[role] + 1 if is_high else 0
            self._low[role] = self._low[role] + 1 if is_low else 0
        has_room = sum(s.num_workers for s in signals.values()) < self.config.total_limit
        change = self._choose(Situation(now, signals, assessments, can_start, has_room))
        if change is not None:
            action, role, evidence = change
            if action is Action.SWITCH:
                self._last_switch = (now, role, evidence.severity)
            hold = self.config.resolved_cooldown_s
            if action is not Action.REMOVE:  # a pool gained a worker: let it show its effect
                hold = max(hold, self.config.grace_s)
            self._hold_until = now + hold
            self._high = dict.fromkeys(PoolRole, 0)
            self._low = dict.fromkeys(PoolRole, 0)
        return change

    def _choose(self, seen: Situation) -> Change | None:
        """The first rule that applies, on the pressed pools (most severe first), then on the
        quiet ones (longest quiet first)."""
        config = self.config
        pressed = sorted(
            (r for r in PoolRole if self._high[r] >= config.scale_up_intervals),
            key=lambda r: -seen.assessments[r].severity,
        )
        quiet = sorted(
            (r for r in PoolRole if self._low[r] >= config.scale_down_intervals),
            key=lambda r: -self._low[r],
        )
        for streak, roles in ((Pressure.HIGH, pressed), (Pressure.LOW, quiet)):
            for role in roles:
                for rule in RULES:
                    if rule.streak is streak and (change := rule.apply(self, seen, role)):
                        return change
        return None

    def num_to_add(
        self, role: PoolRole, severity: float, signals: Mapping[PoolRole, PoolSignals]
    ) -> int:
        """An addition's size: the pool `severity` times past its target wants
        ceil(n * severity) - n more, within `max_step_workers` and the room left."""
        config = self.config
        num = signals[role].num_workers
        room = min(
            config.bounds(role)[1] - num,
            config.total_limit - sum(s.num_workers for s in signals.values()),
        )
        wanted = math.ceil(max(num, 1) * severity) - num
        return max(1, min(wanted, room, config.max_step_workers))

    def is_idle(self, role: PoolRole) -> bool:
        """Whether `role`'s pool has been LOW long enough to give up a worker to the other."""
        return self._low[role] >= self.config.scale_up_intervals

    def may_switch_into(self, role: PoolRole, severity: float, now: float) -> bool:
        """No flapping: undoing the latest switch soon after it needs evidence at least
        `REVERSAL_MARGIN` times as strong as what decided it (when neither layout meets the
        SLOs, the planner keeps the one whose miss is smaller)."""
        if self._last_switch is None:
            return True
        when, fed, decided_by = self._last_switch
        config = self.config
        window = config.grace_s + REVERSAL_INTERVALS * config.interval_s
        is_reversal = fed is not role and now - when < window
        return not is_reversal or severity >= REVERSAL_MARGIN * decided_by


@dataclass(frozen=True)
class Tick:
    """What the controller saw and decided at one tick (the decision log's entry)."""

    time_s: float
    signals: Mapping[PoolRole, PoolSignals]
    decision: Decision | None

    def to_dict(self) -> dict:
        return {
            "time_s": round(self.time_s, 3),
            "signals": {role.value: s.to_dict() for role, s in self.signals.items()},
            "decision": self.decision.to_dict() if self.decision else None,
        }


class AutoscaleController:
    """The whole decision side of one autoscaler: samples → signals → `Planner` → which
    worker. Drivers call `tick` only while no change of theirs is still under way.

    With `replay`, the controller makes those decisions instead, each at the first tick at or
    after its time (its worker, if gone, becomes the least loaded of the same pool): the
    simulator judged on a live planner's path rather than its own."""

    def __init__(self, config: AutoscaleConfig, replay: Sequence[Decision] = ()) -> None:
        self.config = config
        self.planner = Planner(config)
        self.ticks: deque[Tick] = deque(maxlen=MAX_TICKS)
        self.decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS)
        self._previous: dict[str, WorkerSample] = {}
        self._previous_time = 0.0  # the drivers' clocks start at 0 with the controller
        self.is_replaying = bool(replay)
        self._replay = deque(sorted(replay, key=lambda d: d.time_s))

    def tick(
        self,
        now: float,
        samples: Sequence[WorkerSample],
        can_start: Mapping[PoolRole, bool],
    ) -> Decision | None:
        """`samples`: the routable workers, in the order they joined their pools."""
        signals = fleet_signals(self._previous, samples, now - self._previous_time)
        self._previous = {s.key: s for s in samples}
        self._previous_time = now
        if self.is_replaying:
            decision = self._replayed(now, samples)
        else:
            decision = self._decided(now, samples, signals, can_start)
        if decision is not None:
            self.decisions.append(decision)
        self.ticks.append(Tick(now, signals, decision))
        return decision

    def _decided(
        self,
        now: float,
        samples: Sequence[WorkerSample],
        signals: Mapping[PoolRole, PoolSignals],
        can_start: Mapping[PoolRole, bool],
    ) -> Decision | None:
        change = self.planner.decide(now, signals, can_start)
        if change is None:
            return None
        action, role, evidence = change
        worker_id, num_workers = None, 1
        if action is Action.ADD:
            num_workers = self.planner.num_to_add(role, evidence.severity, signals)
        else:
            worker_id = _least_loaded([s for s in samples if s.role is _source(action, role)])
        return Decision(now, action, role, evidence.reason, evidence.detail, worker_id, num_workers)

    def _replayed(self, now: float, samples: Sequence[WorkerSample]) -> Decision | None:
        if not self._replay or self._replay[0].time_s > now:
            return None
        decision = replace(self._replay.popleft(), time_s=now)
        if decision.action is Action.ADD:
            return decision
        pool = [s for s in samples if s.role is _source(decision.action, decision.role)]
        if decision.worker_id in {s.worker_id for s in pool}:
            return decision
        if not pool:
            return None  # nothing left to remove or switch: the path has diverged
        return replace(decision, worker_id=_least_loaded(pool))


def _source(action: Action, role: PoolRole) -> PoolRole:
    """The pool a removal or switch takes its worker from."""
    return role if action is Action.REMOVE else OTHER_ROLE[role]


def _least_loaded(samples: Sequence[WorkerSample]) -> str:
    """The worker with the least in flight; among equals the newest (it has cached least)."""
    order = {s.worker_id: i for i, s in enumerate(samples)}
    best = min(
        samples,
        key=lambda s: (
            s.num_running + s.num_waiting,
            s.num_pending_prompt_tokens,
            -order[s.worker_id],
        ),
    )
    return best.worker_id


def _fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
