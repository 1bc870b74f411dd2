"""The autoscaler's decisions: each pool sized on its own signal. Pure Python: signals in,
decisions out (no clock, no I/O, no torch).

The router's planner loop (`router.autoscaler`) and `pdserve simulate --autoscale`
(`sim.autoscale`) both hand an `AutoscaleController` one `WorkerSample` per worker each tick
(what its /metrics said, plus the router's pending prompt tokens on it) and carry out what it
decides, so a simulated replay decides exactly as the live router would on the same samples.

Each tick (every `interval_s`):
1. `fleet_signals`: per pool, gauges summed over its workers, and TTFT / ITL p90 over the
   interval from the histograms' bucket deltas (as Prometheus' ``histogram_quantile``). An
   empty prefill pool's demand is read on the decode workers, which then prefill locally.
2. Each pool's `Pressure`: HIGH (prefill: TTFT p90 over the SLO, a queue, or too many pending
   prompt tokens; decode: ITL p90 over the SLO, a queue, or the KV cache nearly full), LOW (p90
   well under the SLO, nothing queued, and the load fits on one worker less) or NORMAL.
   Hysteresis: HIGH counts after `scale_up_intervals` ticks in a row, LOW after
   `scale_down_intervals`.
3. At most one change per tick, none within `cooldown_s` of the previous one or `grace_s` of
   an addition (the new worker has to show its effect first, as NVIDIA Dynamo's SLA planner
   waits), and the evidence starts afresh after each change:
   - a HIGH pool below its maximum takes a worker of the other pool when that one is LOW and
     above its minimum (a role switch: no weights loaded, no core added), else gets a new
     worker when there is room (`max_workers`, and the provisioner's `can_start`);
   - at the limit, small fleets rebalance by switching: a lone prefill worker that cannot keep
     up while the decode pool idles becomes a decode worker (merge: every decode worker then
     prefills its own prompts), and without a prefill pool, decode workers whose ITL suffers
     give one of themselves to prefill (split: the others stop stalling on prefills);
   - otherwise a LOW pool above its minimum drains one worker (removal always drains first).
   A switch, like an addition, is followed by the grace period, and undoing it within
   `grace_s + REVERSAL_INTERVALS * interval_s` takes evidence `REVERSAL_MARGIN` times as
   strong as what decided it (so a fleet where no layout meets the SLOs does not flap).
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdserve.router.policies import PoolRole

OTHER_ROLE = {PoolRole.PREFILL: PoolRole.DECODE, PoolRole.DECODE: PoolRole.PREFILL}
# How much stronger the evidence must be to undo a switch, within the grace period plus this
# many intervals of it.
REVERSAL_MARGIN = 2.0
REVERSAL_INTERVALS = 10


# ---- configuration ---------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    """Latency targets the planner holds each pool to (None: that signal is not used)."""

    ttft_s: float | None = None
    itl_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """``ttft:MS,itl:MS`` (either may be left out); raises ValueError naming --slo."""
        values: dict[str, float] = {}
        for part in (text or "").split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in ("ttft", "itl"):
                raise ValueError(f"--slo: expected ttft:MS,itl:MS, got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--slo: {name} must be milliseconds, got {value!r}") from None
            if not ms > 0 or not math.isfinite(ms):
                raise ValueError(f"--slo: {name} must be a positive number of ms, got {value}")
            values[f"{name}_s"] = ms / 1000
        return cls(**values)

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": _ms(self.ttft_s), "itl_ms": _ms(self.itl_s)}


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds, targets and pace of the autoscaler (`AUTOSCALE_FLAGS` give the first ones)."""

    min_prefill_workers: int = 0
    max_prefill_workers: int = 1
    min_decode_workers: int = 1
    max_decode_workers: int = 1
    # Workers of both pools together (the cores or devices the fleet may use); None: the
    # sum of the pools' maxima.
    max_workers: int | None = None
    slo: SLO = field(default_factory=SLO)
    interval_s: float = 10.0
    scale_up_intervals: int = 2
    scale_down_intervals: int = 6
    # No change within this long of the previous one (None: one interval).
    cooldown_s: float | None = None
    # No change within this long of adding a worker.
    grace_s: float = 30.0
    allow_role_switch: bool = True
    # LOW needs the p90 under this fraction of its SLO.
    low_fraction: float = 0.5
    # Waiting requests per worker that make a queue (HIGH).
    queue_high: float = 2.0
    # KV cache usage that is HIGH; LOW needs the pool's usage to fit under `kv_low` on one
    # worker less.
    kv_high: float = 0.9
    kv_low: float = 0.5
    # Pending prompt tokens per prefill worker that are HIGH (None: not a signal).
    prefill_tokens_high: int | None = None
    # A prefill pool is LOW only if its busy time would fit on one worker less below this
    # fraction; its last worker goes only if its prompts would take at most
    # `local_prefill_share` of each decode worker's time (they stall its streams there).
    # (Busy time says nothing of a decode worker's room: it steps back to back even for
    # one stream, and batches more at little cost; decode LOW reads KV and queues.)
    utilization_low: float = 0.6
    local_prefill_share: float = 0.2

    def __post_init__(self) -> None:
        for role in PoolRole:
            low, high = self.bounds(role)
            if not 0 <= low <= high:
                raise ValueError(
                    f"--min-{role.value}-workers must be in [0, --max-{role.value}-workers], "
                    f"got {low} and {high}"
                )
        if self.min_decode_workers < 1:
            raise ValueError("--min-decode-workers must be >= 1: every request ends on one")
        if self.max_workers is not None and self.max_workers < self.min_total:
            raise ValueError(
                f"max_workers {self.max_workers} is below the pools' minima ({self.min_total})"
            )
        for name in (
            "interval_s",
            "low_fraction",
            "queue_high",
            "kv_high",
            "kv_low",
            "utilization_low",
            "local_prefill_share",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("scale_up_intervals", "scale_down_intervals"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0 or (self.cooldown_s is not None and self.cooldown_s < 0):
            raise ValueError("grace_s and cooldown_s must be >= 0")

    def bounds(self, role: PoolRole) -> tuple[int, int]:
        if role is PoolRole.PREFILL:
            return self.min_prefill_workers, self.max_prefill_workers
        return self.min_decode_workers, self.max_decode_workers

    @property
    def min_total(self) -> int:
        return self.min_prefill_workers + self.min_decode_workers

    @property
    def total_limit(self) -> int:
        return self.max_workers or self.max_prefill_workers + self.max_decode_workers

    @property
    def resolved_cooldown_s(self) -> float:
        return self.interval_s if self.cooldown_s is None else self.cooldown_s

    def clamp(self, role: PoolRole, num_workers: int) -> int:
        low, high = self.bounds(role)
        return min(max(num_workers, low), high)

    def to_dict(self) -> dict:
        return {
            "min_prefill_workers": self.min_prefill_workers,
            "max_prefill_workers": self.max_prefill_workers,
            "min_decode_workers": self.min_decode_workers,
            "max_decode_workers": self.max_decode_workers,
            "max_workers": self.total_limit,
            "slo": self.slo.to_dict(),
            "interval_s": self.interval_s,
            "cooldown_s": self.resolved_cooldown_s,
            "grace_s": self.grace_s,
            "scale_up_intervals": self.scale_up_intervals,
            "scale_down_intervals": self.scale_down_intervals,
            "allow_role_switch": self.allow_role_switch,
        }


# ---- samples and signals ---------------------------------------------------------------
@dataclass(frozen=True)
class Histogram:
    """A histogram as Prometheus exports it: cumulative counts at ascending upper bounds,
    the last one +Inf."""

    bounds: tuple[float, ...] = (math.inf,)
    counts: tuple[float, ...] = (0.0,)

    @property
    def count(self) -> float:
        return self.counts[-1]

    def minus(self, earlier: Histogram | None) -> Histogram:
        """Observations since `earlier` (None, other bounds or a reset counter: all of them)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.count > self.count:
            return self
        return Histogram(
            self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True))
        )

    def plus(self, other: Histogram) -> Histogram:
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        if other.bounds != self.bounds:
            raise ValueError("cannot add histograms with different buckets")
        return Histogram(
            self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        )

    def quantile(self, q: float) -> float | None:
        """Linear within the bucket the rank falls in (``histogram_quantile``); None when
        empty; the highest finite bound when the rank falls in the +Inf bucket."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        index = bisect.bisect_left(self.counts, rank)
        upper = self.bounds[index]
        if math.isinf(upper):
            return self.bounds[-2] if len(self.bounds) > 1 else None
        lower = self.bounds[index - 1] if index else 0.0
        below = self.counts[index - 1] if index else 0.0
        in_bucket = self.counts[index] - below
        return lower + (upper - lower) * ((rank - below) / in_bucket if in_bucket else 1.0)


class HistogramRecorder:
    """Observations counted into fixed buckets (the simulator's side of `Histogram`)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = (*sorted(bounds), math.inf)
        self._counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1

    def snapshot(self) -> Histogram:
        cumulative, total = [], 0.0
        for count in self._counts:
            total += count
            cumulative.append(total)
        return Histogram(self.bounds, tuple(cumulative))


@dataclass(frozen=True)
class WorkerSample:
    """One worker at one tick: its /metrics gauges and latency histograms (cumulative), and
    the prompt tokens the router has sent it and not yet seen answered. `key` names the
    process (its URL), so a worker that changed pools keeps its histograms' history."""

    worker_id: str
    key: str
    role: PoolRole
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_pending_prompt_tokens: int = 0
    # Seconds the engine has spent in steps since it started (a counter).
    busy_s: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)


@dataclass(frozen=True)
class PoolSignals:
    """A pool over one interval. `ttft_p90_s`/`itl_p90_s` None: nothing was observed."""

    num_workers: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_pending_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0  # summed over the workers (2.0: two full caches)
    # Busy fraction over the interval, summed over the workers (1.5: one and a half busy).
    utilization: float = 0.0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None

    def to_dict(self) -> dict:
        return {
            "num_workers": self.num_workers,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_pending_prompt_tokens": self.num_pending_prompt_tokens,
            "kv_cache_usage": round(self.kv_cache_usage, 4),
            "utilization": round(self.utilization, 4),
            "ttft_p90_ms": _ms(self.ttft_p90_s),
            "itl_p90_ms": _ms(self.itl_p90_s),
        }


def fleet_signals(
    previous: Mapping[str, WorkerSample], samples: Sequence[WorkerSample], elapsed_s: float
) -> dict[PoolRole, PoolSignals]:
    """Each pool's signals from this tick's samples and the previous tick's (by key),
    `elapsed_s` apart."""
    signals = {}
    for role in PoolRole:
        pool = [s for s in samples if s.role is role]
        ttft, itl, busy_s = Histogram(), Histogram(), 0.0
        for sample in pool:
            earlier = previous.get(sample.key)
            ttft = ttft.plus(sample.ttft.minus(earlier.ttft if earlier else None))
            itl = itl.plus(sample.itl.minus(earlier.itl if earlier else None))
            since = earlier.busy_s if earlier and earlier.busy_s <= sample.busy_s else 0.0
            busy_s += min(sample.busy_s - since, elapsed_s)
        signals[role] = PoolSignals(
            num_workers=len(pool),
            num_running=sum(s.num_running for s in pool),
            num_waiting=sum(s.num_waiting for s in pool),
            num_pending_prompt_tokens=sum(s.num_pending_prompt_tokens for s in pool),
            kv_cache_usage=sum(s.kv_cache_usage for s in pool),
            utilization=busy_s / elapsed_s if elapsed_s > 0 else 0.0,
            ttft_p90_s=ttft.quantile(0.9),
            itl_p90_s=itl.quantile(0.9),
        )
    prefill, decode = signals[PoolRole.PREFILL], signals[PoolRole.DECODE]
    if prefill.num_workers == 0:
        # No prefill pool: the decode workers prefill, so their TTFT and queue are its demand.
        signals[PoolRole.PREFILL] = replace(
            prefill,
            num_running=decode.num_running,
            num_waiting=decode.num_waiting,
            ttft_p90_s=decode.ttft_p90_s,
        )
    return signals


# ---- decisions -------------------------------------------------------------------------
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
    other pool) or loses one (remove); `worker_id` is the worker removed or switched."""

    time_s: float
    action: Action
    role: PoolRole
    reason: str
    detail: str
    worker_id: str | None = None

    @property
    def direction(self) -> str:
        return _DIRECTION[self.action]

    def describe(self) -> str:
        if self.action is Action.ADD:
            what = f"add a {self.role.value} worker"
        elif self.action is Action.REMOVE:
            what = f"drain {self.role.value} worker {self.worker_id}"
        else:
            what = f"switch {self.worker_id} to {self.role.value}"
        return f"{what}: {self.detail}"

    def to_dict(self) -> dict:
        return {
            "time_s": round(self.time_s, 3),
            "action": self.action.value,
            "role": self.role.value,
            "direction": self.direction,
            "reason": self.reason,
            "detail": self.detail,
            "worker_id": self.worker_id,
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
    target, p90 = (
        (config.slo.ttft_s, signals.ttft_p90_s)
        if role is PoolRole.PREFILL
        else (config.slo.itl_s, signals.itl_p90_s)
    )
    quiet = signals.num_waiting == 0 and (
        p90 is None or target is None or p90 <= config.low_fraction * target
    )
    n = signals.num_workers
    if role is PoolRole.DECODE and n > 1:
        quiet = quiet and signals.kv_cache_usage / (n - 1) <= config.kv_low
    if role is PoolRole.PREFILL and n:
        quiet = quiet and signals.utilization / max(n - 1, 1) <= config.utilization_low
    return quiet


class Planner:
    """Hysteresis, cooldown and bounds over `assess` (see the module docstring)."""

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
    ) -> tuple[Action, PoolRole, Assessment] | None:
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
        change = self._choose(now, signals, can_start, assessments)
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

    def _choose(
        self,
        now: float,
        signals: Mapping[PoolRole, PoolSignals],
        can_start: Mapping[PoolRole, bool],
        assessments: Mapping[PoolRole, Assessment],
    ) -> tuple[Action, PoolRole, Assessment] | None:
        config = self.config
        total = sum(s.num_workers for s in signals.values())
        pressing = sorted(
            (r for r in PoolRole if self._high[r] >= config.scale_up_intervals),
            key=lambda r: -assessments[r].severity,
        )
        for role in pressing:
            change = self._grow(
                role, signals, total < config.total_limit, can_start, assessments, now
            )
            if change is not None:
                return change
        quiet = sorted(
            (r for r in PoolRole if self._low[r] >= config.scale_down_intervals),
            key=lambda r: -self._low[r],
        )
        for role in quiet:
            if signals[role].num_workers > config.bounds(role)[0] and self._may_remove(
                role, signals
            ):
                return Action.REMOVE, role, assessments[role]
        return None

    def _may_remove(self, role: PoolRole, signals: Mapping[PoolRole, PoolSignals]) -> bool:
        """The last prefill worker goes only if its prompts fit the decode workers' share."""
        prefill = signals[PoolRole.PREFILL]
        if role is PoolRole.DECODE or prefill.num_workers > 1:
            return True
        num_decode = signals[PoolRole.DECODE].num_workers
        return prefill.utilization <= self.config.local_prefill_share * num_decode

    def _grow(
        self,
        role: PoolRole,
        signals: Mapping[PoolRole, PoolSignals],
        has_room: bool,
        can_start: Mapping[PoolRole, bool],
        assessments: Mapping[PoolRole, Assessment],
        now: float,
    ) -> tuple[Action, PoolRole, Assessment] | None:
        """Relief for a pressed pool: a worker of the idle other pool, else a new one; at the
        limit, on small fleets, a merge or a split (below)."""
        config = self.config
        other = OTHER_ROLE[role]
        num, num_other = signals[role].num_workers, signals[other].num_workers
        is_other_idle = self._low[other] >= config.scale_up_intervals
        severity = assessments[role].severity
        can_switch = config.allow_role_switch
        if num < config.bounds(role)[1]:
            # Not into an empty prefill pool: the decode workers there all prefill already,
            # and one of them on prefill alone would have less room for it, not more.
            if (
                can_switch
                and is_other_idle
                and num_other > config.bounds(other)[0]
                and not (role is PoolRole.PREFILL and num == 0)
                and self._may_switch_into(role, severity, now)
            ):
                return Action.SWITCH, role, assessments[role]
            if has_room and can_start.get(role, False):
                return Action.ADD, role, assessments[role]
        if not can_switch:
            return None
        decode_bounds, prefill_bounds = (
            config.bounds(PoolRole.DECODE),
            config.bounds(PoolRole.PREFILL),
        )
        if (
            role is PoolRole.PREFILL
            and num == 1 > prefill_bounds[0]
            and is_other_idle
            and num_other < decode_bounds[1]
            and self._may_switch_into(PoolRole.DECODE, severity, now)
        ):
            # Merge: a lone prefill worker cannot keep up while the decode pool idles at its
            # minimum. As a decode worker it adds its core to the idle ones, and every decode
            # worker prefills its own prompts.
            evidence = assessments[role]
            detail = f"{evidence.detail}; decode pool idle: it takes the prefills"
            return Action.SWITCH, PoolRole.DECODE, replace(evidence, detail=detail)
        if (
            role is PoolRole.DECODE
            and signals[PoolRole.PREFILL].num_workers == 0
            and assessments[role].reason == "itl"
            and num > decode_bounds[0]
            and prefill_bounds[1] >= 1
            and self._may_switch_into(PoolRole.PREFILL, severity, now)
        ):
            # Split: decode workers that prefill their own prompts stall their streams; one of
            # them takes every prefill so the others stream undisturbed.
            evidence = assessments[role]
            detail = f"{evidence.detail}; local prefills stall the streams"
            return Action.SWITCH, PoolRole.PREFILL, replace(evidence, detail=detail)
        return None

    def _may_switch_into(self, role: PoolRole, severity: float, now: float) -> bool:
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
    worker. Drivers call `tick` only while no change of theirs is still under way."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self.planner = Planner(config)
        self.ticks: list[Tick] = []
        self._previous: dict[str, WorkerSample] = {}
        self._previous_time = 0.0  # the drivers' clocks start at 0 with the controller

    @property
    def decisions(self) -> list[Decision]:
        return [t.decision for t in self.ticks if t.decision is not None]

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
        change = self.planner.decide(now, signals, can_start)
        decision = None
        if change is not None:
            action, role, evidence = change
            worker_id = None
            if action is not Action.ADD:
                source = role if action is Action.REMOVE else OTHER_ROLE[role]
                worker_id = _least_loaded([s for s in samples if s.role is source])
            decision = Decision(now, action, role, evidence.reason, evidence.detail, worker_id)
        self.ticks.append(Tick(now, signals, decision))
        return decision


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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
