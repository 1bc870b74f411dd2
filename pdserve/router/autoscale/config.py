"""`AutoscaleConfig`: the autoscaler's bounds, targets and pace, and `--slo`'s targets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pdserve.router.policies import PoolRole


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
        return {"ttft_ms": to_ms(self.ttft_s), "itl_ms": to_ms(self.itl_s)}


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
    # The most workers one addition starts. A pool `severity` times past its target gets
    # ceil(n * severity) - n at once (Kubernetes' HPA sizes replicas the same way), so a
    # fleet of 64 reaches its size in a few graces, not one worker per grace.
    max_step_workers: int = 1
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
    # At the fleet's limit a pressed pool takes a worker of the other pool when that one's
    # load (prefill: busy time; decode: KV in use) fits on one worker less below this
    # fraction, with nothing queued and its p90 under `low_fraction` of its SLO: eight prefill
    # workers 70% busy can spare one; two cannot.
    spare_fraction: float = 0.8

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
            "spare_fraction",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("scale_up_intervals", "scale_down_intervals", "max_step_workers"):
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

    def within(self, room: int) -> AutoscaleConfig:
        """These bounds on a fleet that can run at most `room` workers at once (its cores)."""
        return replace(self, max_workers=room) if room < self.total_limit else self

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
            "max_step_workers": self.max_step_workers,
            "scale_up_intervals": self.scale_up_intervals,
            "scale_down_intervals": self.scale_down_intervals,
            "allow_role_switch": self.allow_role_switch,
        }


def to_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
