"""Fit the cost model's efficiency factors and overheads to measured engine step times.

Samples are steps of the real engine: the batch composition (new tokens and context per
sequence) and the wall time of the step. The fit searches a log-spaced grid of the three
efficiencies (linear compute, attention compute, memory bandwidth) and, for each point,
solves the two overheads (per step, per sequence) by least squares on relative error; a
few finer grids around the best point refine it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.errors import SimConfigError
from pdserve.sim.linear_curve import CurveFit

_COARSE_GRID = np.geomspace(0.002, 1.0, 28)
# Each refinement searches this factor either side of the previous best.
_REFINEMENTS = (1.6, 1.1, 1.02)
_FINE_STEPS = 15
# Outliers: off by more than this × the median relative error (and at least this much).
_OUTLIER_FACTOR = 3.0
_MIN_OUTLIER_ERROR = 0.25
# Reweighting rounds, and the error below which a sample's weight stops growing.
_REWEIGHTINGS = 4
_MIN_WEIGHTED_ERROR = 0.01
# Step-time jitter: quantiles kept (every 1%), and the samples needed to estimate them.
_JITTER_QUANTILES = 101
_MIN_JITTER_SAMPLES = 20


@dataclass(frozen=True)
class StepSample:
    """One measured engine step."""

    batch: tuple[SeqWork, ...]
    step_s: float

    def to_dict(self) -> dict:
        return {"batch": [list(seq) for seq in self.batch], "step_s": self.step_s}


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    # |predicted − measured| / measured over the samples kept.
    mean_abs_rel_error: float
    max_abs_rel_error: float
    num_samples: int
    # Samples set aside as disturbed (see `fit_efficiency`); errors are over the rest.
    num_outliers: int = 0

    def metadata(self) -> dict:
        return {
            "mean_abs_rel_error": self.mean_abs_rel_error,
            "max_abs_rel_error": self.max_abs_rel_error,
            "num_samples": self.num_samples,
            "num_outliers": self.num_outliers,
        }


def save_samples(samples: Sequence[StepSample], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))


def load_samples(path: str | Path) -> list[StepSample]:
    """Step samples from JSONL (`{"batch": [[new, context, sampling], ...], "step_s": t}`
    per line) or from `benchmarks/engine.py --json` output (its bfloat16 run)."""
    path = Path(path)
    try:
        text = path.read_text()
        if text.lstrip().startswith("{") and '"runs"' in text:
            return _engine_bench_samples(json.loads(text))
        return [_sample(json.loads(line)) for line in text.splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SimConfigError(f"--steps: cannot read step samples from {path}: {exc}") from None


def _sample(row: dict) -> StepSample:
    batch = tuple(SeqWork(int(n), int(c), bool(s)) for n, c, s in row["batch"])
    if not batch or not row["step_s"] > 0:
        raise ValueError("a sample needs a non-empty batch and a positive step_s")
    return StepSample(batch, float(row["step_s"]))


# benchmarks/engine.py: decode sequences hold 512 tokens of context, and prefills are alone.
_ENGINE_BENCH_DECODE_CONTEXT = 512


def _engine_bench_samples(result: dict) -> list[StepSample]:
    runs = [r for r in result["runs"] if r["dtype"] == "bfloat16"] or result["runs"]
    run = runs[0]
    samples = [
        StepSample((SeqWork(int(length), 0, True),), int(length) / r["pdserve_tokens_per_s"])
        for length, r in run["prefill"].items()
    ]
    samples += [
        StepSample(
            (SeqWork(1, _ENGINE_BENCH_DECODE_CONTEXT, True),) * int(batch),
            r["pdserve_step_ms"] / 1000,
        )
        for batch, r in run["decode"].items()
    ]
    return samples


def fit_efficiency(
    cost_model: CostModel, samples: Sequence[StepSample], network: float = 1.0
) -> Fit:
    """The efficiency that best predicts `samples` on `cost_model`'s model and hardware.

    Steps slowed by something else on the machine (another process taking a core) would
    drag a least-squares fit, so it is made robust: a few rounds of reweighting each sample
    by the inverse of its error (approaching least absolute relative error), then samples
    off by more than `_OUTLIER_FACTOR` × the median error are set aside for a last fit.
    The jitter the simulator draws from is how the kept samples' measured times spread
    around the model's (the set-aside steps stay out of it too: they are the calibration
    machine's accidents, not the served engine's normal variation).
    """
    if len(samples) < 3:
        raise SimConfigError(f"calibration needs at least 3 step samples, got {len(samples)}")
    weights = np.ones(len(samples))
    for _ in range(_REWEIGHTINGS):
        fit = _fit(cost_model, samples, network, weights)
        errors = _errors(cost_model, fit, samples)
        weights = 1.0 / np.sqrt(np.maximum(errors, _MIN_WEIGHTED_ERROR))
    limit = max(_OUTLIER_FACTOR * float(np.median(errors)), _MIN_OUTLIER_ERROR)
    kept = [s for s, e in zip(samples, errors, strict=True) if e <= limit]
    if len(samples) > len(kept) >= 3:
        fit = _fit(cost_model, kept, network, np.ones(len(kept)))
    errors = _errors(cost_model, fit, kept)
    if len(kept) >= _MIN_JITTER_SAMPLES:
        predicted = np.array(_predictions(cost_model, fit, kept))
        ratios = np.array([s.step_s for s in kept]) / predicted
        quantiles = np.quantile(ratios, np.linspace(0, 1, _JITTER_QUANTILES))
        fit = dataclasses.replace(
            fit,
            step_jitter=tuple(round(float(q), 4) for q in quantiles),
            jitter_step_s=float(np.median(predicted)),
        )
    return Fit(
        fit, float(np.mean(errors)), float(np.max(errors)), len(kept), len(samples) - len(kept)
    )


def _fit(
    cost_model: CostModel, samples: Sequence[StepSample], network: float, weights: np.ndarray
) -> Efficiency:
    """The roofline efficiencies; then, keeping its attention terms (refitting them beside a
    curve this flexible trades attention against negative curve values), the linear curve,
    if it predicts the samples better (it cannot where few row counts were measured)."""
    terms = _Terms(cost_model, samples, weights)
    best = terms.search(_COARSE_GRID, _COARSE_GRID, _COARSE_GRID)
    for factor in _REFINEMENTS:
        best = terms.search(*(_around(v, factor) for v in best[:3]))
    linear, attention, memory, step_overhead, per_seq = best
    roofline = Efficiency(
        linear_compute=linear,
        attention_compute=attention,
        memory=memory,
        network=network,
        step_overhead_s=step_overhead,
        per_seq_overhead_s=per_seq,
    )
    curve = CurveFit(
        cost_model,
        samples,
        weights / terms.times,
        lambda a, m: terms.attention_s(np.array([a]), np.array([m]))[:, 0, 0],
    )
    if not curve.is_possible:
        return roofline
    knots, per_seq = curve.solve(attention, memory)
    curved = dataclasses.replace(
        roofline, step_overhead_s=0.0, per_seq_overhead_s=per_seq, linear_curve=knots
    )
    losses = [
        float(np.sum((weights * _errors(cost_model, e, samples)) ** 2)) for e in (roofline, curved)
    ]
    return curved if losses[1] < losses[0] else roofline


def _around(value: float, factor: float) -> np.ndarray:
    return np.geomspace(max(value / factor, 1e-4), min(value * factor, 1.0), _FINE_STEPS)


def _errors(
    cost_model: CostModel, efficiency: Efficiency, samples: Sequence[StepSample]
) -> list[float]:
    """|predicted − measured| / measured per sample."""
    return [
        abs(p - s.step_s) / s.step_s
        for s, p in zip(samples, _predictions(cost_model, efficiency, samples), strict=True)
    ]


def _predictions(
    cost_model: CostModel, efficiency: Efficiency, samples: Sequence[StepSample]
) -> list[float]:
    model = CostModel(
        cost_model.model,
        cost_model.hardware,
        cost_model.tp,
        dtype=cost_model.dtype,
        kv_dtype=cost_model.kv_dtype,
        efficiency=efficiency,
        inter_node_link=cost_model.tp_link,
    )
    return [model.step_time(s.batch) for s in samples]


class _Terms:
    """Per-sample seconds at 100% of each peak, to evaluate a grid of efficiencies at once."""

    def __init__(
        self, cost_model: CostModel, samples: Sequence[StepSample], weights: np.ndarray
    ) -> None:
        peak_flops, peak_attn = cost_model.peak_linear_flops, cost_model.peak_attention_flops
        bandwidth = cost_model.hardware.memory_bandwidth
        self.samples = samples
        self.works = []
        for sample in samples:
            work = cost_model.step_work(sample.batch)
            attention = np.array(work.attention).reshape(-1, 2)
            self.works.append(
                (
                    (work.linear[0] / peak_flops, work.linear[1] / bandwidth),
                    (work.lm_head[0] / peak_flops, work.lm_head[1] / bandwidth),
                    (attention[:, 0] / peak_attn, attention[:, 1] / bandwidth),
                )
            )
        self.times = np.array([s.step_s for s in samples])
        # Relative error, each sample scaled by its robustness weight.
        self.weights = weights / self.times
        self.num_seqs = np.array([len(s.batch) for s in samples], dtype=float)

    def attention_s(self, attention: np.ndarray, memory: np.ndarray) -> np.ndarray:
        """[k, a, m]: attention seconds of sample k at efficiencies (a, m)."""
        inv_a, inv_m = 1 / attention, 1 / memory
        return np.stack(
            [
                np.maximum(
                    att_c[:, None, None] * inv_a[None, :, None],
                    att_m[:, None, None] * inv_m[None, None, :],
                ).sum(axis=0)
                for _, _, (att_c, att_m) in self.works
            ]
        )

    def search(
        self, linear: np.ndarray, attention: np.ndarray, memory: np.ndarray
    ) -> tuple[float, float, float, float, float]:
        """Best (linear, attention, memory, step overhead, per-seq overhead) on the grid."""
        # predicted[k, l, a, m]: roofline seconds of sample k at efficiencies (l, a, m).
        predicted = np.stack([self._roofline(w, linear, attention, memory) for w in self.works])
        weights = self.weights
        residual = (self.times[:, None, None, None] - predicted) * weights[:, None, None, None]
        overhead, per_seq, loss = _fit_overheads(residual, weights, self.num_seqs * weights)
        index = np.unravel_index(np.argmin(loss), loss.shape)
        return (
            float(linear[index[0]]),
            float(attention[index[1]]),
            float(memory[index[2]]),
            float(overhead[index]),
            float(per_seq[index]),
        )

    @staticmethod
    def _roofline(work, linear, attention, memory) -> np.ndarray:
        (lin_c, lin_m), (head_c, head_m), (att_c, att_m) = work
        inv_l, inv_a, inv_m = 1 / linear, 1 / attention, 1 / memory
        dense = np.maximum.outer(lin_c * inv_l, lin_m * inv_m) + np.maximum.outer(
            head_c * inv_l, head_m * inv_m
        )  # [l, m]
        attn = np.maximum(
            att_c[:, None, None] * inv_a[None, :, None], att_m[:, None, None] * inv_m[None, None, :]
        ).sum(axis=0)  # [a, m]
        return dense[:, None, :] + attn[None, :, :]


def _fit_overheads(residual: np.ndarray, a: np.ndarray, b: np.ndarray):
    """Least squares of residual ≈ a·overhead + b·per_seq (both >= 0), per grid point.

    `residual` is [k, ...grid]; `a`, `b` are [k]. Returns overhead, per_seq and the loss,
    each shaped like the grid.
    """
    saa, sab, sbb = a @ a, a @ b, b @ b
    ya = np.tensordot(a, residual, axes=1)
    yb = np.tensordot(b, residual, axes=1)
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        overhead = (sbb * ya - sab * yb) / det
        per_seq = (saa * yb - sab * ya) / det
    else:  # every sample has the same batch size: the per-seq term is not identifiable
        overhead, per_seq = ya / saa, np.zeros_like(ya)
    # Where the joint solution is negative, fit the other term alone; then clamp.
    only_overhead = np.maximum(ya / saa, 0.0)
    only_per_seq = np.maximum(yb / sbb, 0.0)
    negative_per_seq = per_seq < 0
    negative_overhead = overhead < 0
    overhead = np.where(negative_per_seq, only_overhead, overhead)
    per_seq = np.where(negative_per_seq, 0.0, per_seq)
    per_seq = np.where(negative_overhead & ~negative_per_seq, only_per_seq, per_seq)
    overhead = np.where(negative_overhead & ~negative_per_seq, 0.0, overhead)
    loss = (
        (residual**2).sum(axis=0)
        - 2 * (overhead * ya + per_seq * yb)
        + overhead**2 * saa
        + 2 * overhead * per_seq * sab
        + per_seq**2 * sbb
    )
    return overhead, per_seq, loss
