"""What the planner sees each tick: one `WorkerSample` per worker (what its /metrics said, plus
the router's pending prompt tokens on it), summed into each pool's `PoolSignals` over the
interval (`fleet_signals`): gauges summed over its workers, TTFT / ITL p90 from the
histograms' bucket deltas. An empty prefill pool's demand is read on the decode workers,
which then prefill locally."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdserve.router.autoscale.config import to_ms
from pdserve.router.autoscale.histogram import Histogram
from pdserve.router.policies import PoolRole


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
            "ttft_p90_ms": to_ms(self.ttft_p90_s),
            "itl_p90_ms": to_ms(self.itl_p90_s),
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
