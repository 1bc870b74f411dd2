"""A simulated run in the benchmark's terms: its metrics code, result JSON and report.

`bench_result` wraps the simulator's per-request records in a `pdserve.workload` `BenchResult`,
so `result_to_dict`, `write_report` and the compare table treat a simulated run exactly like
a measured one. `simulation_summary` adds what only a simulation knows: where time went.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pdserve.sim.config import SimConfig
from pdserve.sim.efficiency import Calibration
from pdserve.sim.simulator import SimResult, simulate
from pdserve.sim.workload import SimRequestSpec
from pdserve.workload import Workload
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.metrics import BenchMetrics, compute_metrics
from pdserve.workload.results import result_to_dict
from pdserve.workload.run import BenchResult, BenchSpec, summarize

# Result files name the server they measured; a simulation names itself.
SIMULATED_BASE_URL = "http://simulated"


def bench_result(
    sim: SimResult,
    workload: Workload,
    *,
    seed: int,
    request_rate: float | None,
    burstiness: float = 1.0,
    slos: Mapping[str, float] | None = None,
    label: str | None = None,
) -> BenchResult:
    """The run as the benchmark would have recorded it (clock zero = simulation start)."""
    spec = BenchSpec(
        endpoint=EndpointConfig(base_url=SIMULATED_BASE_URL),
        workload=workload,
        seed=seed,
        request_rates=(request_rate,),
        burstiness=burstiness,
        max_concurrency=sim.config.max_concurrency,
        num_warmups=0,
        slos=dict(slos or {}),
        show_progress=False,
    )
    return summarize(
        label or sim.config.describe(), sim.config.model.name, spec, request_rate, sim.records, 0.0
    )


def simulation_summary(sim: SimResult) -> dict:
    """The layout, and per pool where the busy time went and how busy the workers were."""
    cfg = sim.config
    pools = {}
    for name, stats in sim.pool_stats.items():
        busy = sum(s.busy_s for s in stats)
        capacity = sim.duration_s * len(stats)
        pools[name] = {
            "num_workers": len(stats),
            "num_kv_blocks": sim.num_kv_blocks[name],
            "num_steps": sum(s.num_steps for s in stats),
            "utilization": busy / capacity if capacity else 0.0,
            "max_step_ms": max((s.max_step_s for s in stats), default=0.0) * 1000,
            "busy_s": {
                part: sum(getattr(s, f"{part}_s") for s in stats)
                for part in ("linear", "attention", "communication", "overhead")
            },
        }
    return {
        "layout": cfg.describe(),
        "model": cfg.model.name,
        "hardware": cfg.hardware.name,
        "network": cfg.network.name,
        "num_devices": cfg.num_devices,
        "efficiency": vars(cfg.resolved_efficiency),
        "simulated_s": sim.duration_s,
        "wall_time_s": sim.wall_time_s,
        "num_events": sim.num_events,
        "pools": pools,
    }


def result_json(sim: SimResult, result: BenchResult) -> dict:
    """The benchmark's result JSON (vLLM keys), with the simulation summary under
    "pdserve" → "simulation" (and the autoscaler's log under "pdserve" → "autoscale")."""
    out = result_to_dict(result)
    out["pdserve"]["simulation"] = simulation_summary(sim)
    if sim.autoscale is not None:
        out["pdserve"]["autoscale"] = sim.autoscale
    return out


# The figures printed with their band: (label, metric, statistic).
BAND_FIGURES = (
    ("TTFT p50", "ttft", "median"),
    ("TTFT p99", "ttft", "p99"),
    ("TPOT p50", "tpot", "median"),
    ("TPOT p99", "tpot", "p99"),
    ("ITL p50", "itl", "median"),
    ("ITL p99", "itl", "p99"),
    ("E2EL p50", "e2el", "median"),
)


def scaled(config: SimConfig, factor: float) -> SimConfig:
    """`config` with every modelled step `factor` times as long."""
    efficiency = config.resolved_efficiency
    return replace(config, efficiency=replace(efficiency, time_scale=factor))


@dataclass(frozen=True)
class Band:
    """A run's figures where the calibration's residuals say they may lie: the same run with
    every step (1 − band) and (1 + band) times as long (so queueing amplifies the error as
    it would the real one). `low`/`high` hold the faster and the slower run's metrics."""

    calibration: str
    band: float
    low: BenchMetrics
    high: BenchMetrics

    def figure(self, metric: str, stat: str) -> tuple[float, float]:
        return getattr(getattr(self.low, metric), stat), getattr(getattr(self.high, metric), stat)

    def lines(self, metrics: BenchMetrics) -> list[str]:
        """One line per figure: its value and its band, in ms."""
        out = [f"with the band of calibration {self.calibration} (every step ±{self.band:.0%}):"]
        for label, metric, stat in BAND_FIGURES:
            low, high = self.figure(metric, stat)
            value = getattr(getattr(metrics, metric), stat)
            out.append(f"  {label:<9} {value:>10,.1f} ms   band {low:,.1f} – {high:,.1f} ms")
        return out

    def to_dict(self) -> dict:
        return {
            "calibration": self.calibration,
            "band": self.band,
            "low": self.low.to_vllm_dict(),
            "high": self.high.to_vllm_dict(),
        }


def simulate_band(
    config: SimConfig,
    specs: Sequence[SimRequestSpec],
    calibration: Calibration,
    slos: Mapping[str, float] | None = None,
) -> Band | None:
    """The run's band (None where the calibration has none: uncalibrated)."""
    if not calibration.band:
        return None
    low, high = (
        compute_metrics(simulate(scaled(config, f), specs).records, dict(slos or {}))
        for f in (1 - calibration.band, 1 + calibration.band)
    )
    return Band(calibration.name, calibration.band, low, high)


def format_decisions(autoscale: dict) -> str:
    """The autoscaler's decisions, one line each, and the worker-seconds the fleet held."""
    lines = [f"autoscaler: {len(autoscale['decisions'])} decisions"]
    for decision in autoscale["decisions"]:
        lines.append(
            f"  {decision['time_s']:8.1f} s  {decision['action']:<6} {decision['role']:<7} "
            f"{decision['worker_id'] or '':<10} {decision['detail']}"
        )
    lines.append(f"worker-seconds: {autoscale['worker_seconds']:.1f}")
    return "\n".join(lines)
