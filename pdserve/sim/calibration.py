"""Fit the cost model's efficiency factors and overheads to measured times.

A measurement is a measured time that the cost model predicts as a sum of engine steps: one
step of a step log, a prompt's prefill chunks (a profile's time to first token), a decode step
at some batch (its inter-token latency), or a whole static-batch run (a published
throughput). The fit searches a log-spaced grid of the three efficiencies (linear compute,
attention compute, memory bandwidth) and, for each point, solves the overheads (per step,
sequence, request and layer: `efficiency.OVERHEADS`) by non-negative least squares on
relative error; a few finer grids around the best point refine it.

Communication has no free term here: a tensor-parallel step's all-reduces cost what the link
says (`sim/network.py`: fitted to the stack's own all-reduce points where it gives them,
else measured NVLink). A free per-all-reduce cost, fitted on a table whose only TP > 1 is
one degree, soaked up whatever else differed at that degree and mispredicted the next one
(TensorRT-LLM's 70B at TP4 from its TP2 rows: +69%; without it: within 8%).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.sim.cost_model import CostModel, SeqWork, overlap
from pdserve.sim.efficiency import FITTED_SHARES, OVERHEADS, PER_STEP_OVERHEADS, Efficiency
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
# Step-time jitter: quantiles kept (every 1%), and the observations needed to estimate them.
_JITTER_QUANTILES = 101
_MIN_JITTER_SAMPLES = 20
# The calibration's band: this quantile of the fitting points' |relative residual|.
BAND_QUANTILE = 0.9
# A fitted share this close to 1 sits at the search's bound (the grid ends at the peak).
_AT_BOUND = 0.995
# Losses closer than this share of the loss before any overhead are equal fits (rounding,
# which differs between CPUs, decides between them otherwise): the first one found is kept.
_TIE_TOLERANCE = 1e-9

Steps = tuple[tuple[int, tuple[SeqWork, ...]], ...]


@dataclass(frozen=True)
class Measurement:
    """A measured time the cost model predicts as a sum of steps on one deployment.

    `steps` holds (count, batch) pairs; `seconds` is the measured total, which includes the
    front end's overhead `num_requests` times (a time to first token holds one). `cost_model`
    is the deployment it was measured on (None: the fit's own). `observations` are the
    single values behind `seconds` where each is one step (a stream's token gaps, a logged
    step): the step-time jitter is how they spread around the model. `linear_only` marks a
    measurement of the decoder layers' linears alone (a kernel-level profile): no attention,
    LM head, communication or overhead is in it.
    """

    steps: Steps
    seconds: float
    num_requests: int = 0
    cost_model: CostModel | None = None
    label: str = ""
    observations: tuple[float, ...] = ()
    linear_only: bool = False

    def __post_init__(self) -> None:
        if not self.steps or any(count < 1 or not batch for count, batch in self.steps):
            raise SimConfigError(f"measurement {self.label!r}: needs steps with batches")
        if not self.seconds > 0:
            raise SimConfigError(f"measurement {self.label!r}: seconds must be positive")

    @property
    def num_steps(self) -> int:
        return sum(count for count, _ in self.steps)

    @property
    def num_seqs(self) -> int:
        return sum(count * len(batch) for count, batch in self.steps)


@dataclass(frozen=True)
class StepSample:
    """One measured engine step."""

    batch: tuple[SeqWork, ...]
    step_s: float

    def to_dict(self) -> dict:
        return {"batch": [list(seq) for seq in self.batch], "step_s": self.step_s}

    def measurement(self) -> Measurement:
        return Measurement(((1, self.batch),), self.step_s, observations=(self.step_s,))


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    # |predicted − measured| / measured over the samples kept.
    mean_abs_rel_error: float
    max_abs_rel_error: float
    num_samples: int
    # Samples set aside as disturbed (see `fit_efficiency`); errors are over the rest.
    num_outliers: int = 0
    # predicted / measured − 1 of every sample (set-aside ones too), in the order given.
    residuals: tuple[float, ...] = ()
    # BAND_QUANTILE of every sample's |residual|, the set-aside ones included: how far a
    # figure may be off (a point the fit chose to ignore is still a point it misses).
    band: float = 0.0
    # The efficiencies (`FITTED_SHARES`) the fit left at 100% of their peak: the search's
    # bound, not a measured share (the model has no term for what the data asked of it).
    at_bound: tuple[str, ...] = ()
    # Per sample, in the order given: whether the last fit kept it (False: set aside).
    kept: tuple[bool, ...] = ()

    @property
    def kept_band(self) -> float:
        """BAND_QUANTILE of the kept samples' |residual| alone (what the fit optimised)."""
        return band_of([r for r, k in zip(self.residuals, self.kept, strict=True) if k])

    def metadata(self) -> dict:
        return {
            "mean_abs_rel_error": self.mean_abs_rel_error,
            "max_abs_rel_error": self.max_abs_rel_error,
            "num_samples": self.num_samples,
            "num_outliers": self.num_outliers,
            "band_over": "every point, set-aside ones included",
            "kept_band": self.kept_band,
            "at_bound": list(self.at_bound),
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
    cost_model: CostModel,
    samples: Sequence[StepSample | Measurement],
    network: float = 1.0,
    *,
    allow_curve: bool = True,
    memory: float | None = None,
    sharpness: float | None = None,
    is_served: bool = False,
) -> Fit:
    """The efficiency that best predicts `samples` on `cost_model`'s model and hardware
    (or on each measurement's own deployment).

    Steps slowed by something else on the machine (another process taking a core) would
    drag a least-squares fit, so it is made robust: a few rounds of reweighting each sample
    by the inverse of its error (approaching least absolute relative error), then samples
    off by more than `_OUTLIER_FACTOR` × the median error are set aside for a last fit.
    The jitter the simulator draws from is how the kept samples' single-step observations
    spread around the model's (the set-aside ones stay out of it too: they are the
    calibration machine's accidents, not the served engine's normal variation), unless
    `is_served`: samples logged by the very runs the simulator is to re-predict, whose
    accidents are part of what was measured.
    `allow_curve` False keeps the roofline (a few published points cannot pin a curve's
    knots down across models); `memory` fixes the bandwidth share instead of fitting it
    (one source tells it, another the rest); `sharpness` is the roofline's
    (`Efficiency.roofline_sharpness`, fixed). With `memory` given, the search's bandwidth
    axis fits `Efficiency.kv_read_amplification` instead.
    """
    shape = Efficiency(roofline_sharpness=sharpness)
    measurements = [s.measurement() if isinstance(s, StepSample) else s for s in samples]
    if len(measurements) < 3:
        raise SimConfigError(f"calibration needs at least 3 measurements, got {len(samples)}")
    weights = np.ones(len(measurements))
    for _ in range(_REWEIGHTINGS):
        fit = _fit(cost_model, measurements, network, weights, allow_curve, memory, shape)
        errors = _errors(cost_model, fit, measurements)
        weights = 1.0 / np.sqrt(np.maximum(errors, _MIN_WEIGHTED_ERROR))
    limit = max(_OUTLIER_FACTOR * float(np.median(errors)), _MIN_OUTLIER_ERROR)
    is_kept = tuple(e <= limit for e in errors)
    kept = [m for m, k in zip(measurements, is_kept, strict=True) if k]
    if len(measurements) > len(kept) >= 3:
        fit = _fit(cost_model, kept, network, np.ones(len(kept)), allow_curve, memory, shape)
    fit = _with_jitter(cost_model, fit, measurements if is_served else kept)
    residuals = [
        p / m.seconds - 1
        for m, p in zip(measurements, _predictions(cost_model, fit, measurements), strict=True)
    ]
    errors = _errors(cost_model, fit, kept)
    return Fit(
        fit,
        float(np.mean(errors)),
        float(np.max(errors)),
        len(kept),
        len(measurements) - len(kept),
        tuple(residuals),
        band_of(residuals),
        tuple(name for name in FITTED_SHARES if (getattr(fit, name) or 0) >= _AT_BOUND),
        is_kept,
    )


def band_of(residuals: Sequence[float]) -> float:
    """BAND_QUANTILE of the residuals' magnitudes."""
    return float(np.quantile(np.abs(residuals), BAND_QUANTILE))


def _with_jitter(
    cost_model: CostModel, efficiency: Efficiency, kept: Sequence[Measurement]
) -> Efficiency:
    """`efficiency` with the quantiles of observed / modelled single steps, and how their
    spread shrinks with the step's length, where enough single-step observations were kept."""
    ratios, typical = [], []
    for m, predicted in zip(kept, _predictions(cost_model, efficiency, kept), strict=True):
        if m.observations:
            one_step = predicted / m.num_steps
            ratios += [o / one_step for o in m.observations]
            typical += [one_step] * len(m.observations)
    if len(ratios) < _MIN_JITTER_SAMPLES:
        return efficiency
    quantiles = np.quantile(ratios, np.linspace(0, 1, _JITTER_QUANTILES))
    return dataclasses.replace(
        efficiency,
        step_jitter=tuple(round(float(q), 4) for q in quantiles),
        jitter_step_s=float(np.median(typical)),
        jitter_decay=_jitter_decay(np.array(ratios), np.array(typical)),
    )


def _jitter_decay(ratios: np.ndarray, step_s: np.ndarray) -> float:
    """The exponent by which the ratios' spread (median absolute deviation) shrinks with the
    modelled step length, from the steps longer than the median one (the draw's reference);
    0.5 (independent interruptions averaging out) where too few long steps tell. Clamped to
    [0, 0.5]: a spread growing with length is the load lasting as long as the steps."""
    reference = float(np.median(step_s))
    spreads, lengths = [], []
    short = step_s <= reference
    for group in [short, *_length_groups(step_s, reference)]:
        if group.sum() >= _MIN_JITTER_SAMPLES:
            r = ratios[group]
            spreads.append(float(np.median(np.abs(r - np.median(r)))))
            lengths.append(float(np.median(step_s[group])))
    if len(spreads) < 2 or min(spreads) <= 0:
        return 0.5
    slope = np.polyfit(np.log(lengths), np.log(spreads), 1)[0]
    return float(np.clip(-slope, 0.0, 0.5))


def _length_groups(step_s: np.ndarray, reference: float) -> list[np.ndarray]:
    """Masks of the steps longer than `reference`, in octaves of length."""
    groups, low = [], reference
    while low < step_s.max():
        groups.append((step_s > low) & (step_s <= 2 * low))
        low *= 2
    return groups


def _fit(
    cost_model: CostModel,
    samples: Sequence[Measurement],
    network: float,
    weights: np.ndarray,
    allow_curve: bool,
    memory: float | None,
    shape: Efficiency,
) -> Efficiency:
    """The roofline efficiencies; then, keeping its attention terms (refitting them beside a
    curve this flexible trades attention against negative curve values), the linear curve,
    if it predicts the samples better (it cannot where few row counts were measured)."""
    # The third axis searched: the bandwidth share, or with it given, attention's own.
    terms = _Terms(cost_model, samples, network, weights, shape, memory)
    best = terms.search(_COARSE_GRID, _COARSE_GRID, _COARSE_GRID)
    for factor in _REFINEMENTS:
        best = terms.search(*(_around(v, factor) for v in best[:3]))
    (linear, attention, third), overheads = best[:3], best[3]
    roofline = dataclasses.replace(
        shape,
        linear_compute=linear,
        attention_compute=attention,
        memory=third if memory is None else memory,
        kv_read_amplification=shape.kv_read_amplification if memory is None else 1 / third,
        network=network,
        **dict(zip(OVERHEADS, overheads, strict=True)),
    )
    # The curve absorbs the per-step overheads (a constant is linear time at a row count).
    beside_curve = [i for i, name in enumerate(OVERHEADS) if name not in PER_STEP_OVERHEADS]
    models = [_model_of(cost_model, m) for m in samples]
    curve = CurveFit(
        np.array([s.seconds for s in samples]),
        [
            [
                (count, sum(q.num_new_tokens for q in batch), sum(q.is_sampling for q in batch))
                for count, batch in s.steps
            ]
            for s in samples
        ],
        [(m.layer_params, m.head_params) for m in models],
        terms.counts[:, beside_curve],
        weights / terms.times,
        lambda a, m: terms.attention_s(np.array([a]), np.array([m]))[:, 0, 0] + terms.comm_s,
    )
    if not (allow_curve and curve.is_possible):
        return roofline
    knots, rest, curve_loss = curve.solve(attention, third)
    curved = dataclasses.replace(
        roofline,
        linear_curve=knots,
        **dict.fromkeys(PER_STEP_OVERHEADS, 0.0),
        **{OVERHEADS[i]: value for i, value in zip(beside_curve, rest, strict=True)},
    )
    # The curve is judged on samples it did not see (its leave-one-out loss), the roofline's
    # few factors on those it fitted.
    roofline_loss = float(np.sum((weights * _errors(cost_model, roofline, samples)) ** 2))
    return curved if curve_loss < roofline_loss else roofline


def _around(value: float, factor: float) -> np.ndarray:
    return np.geomspace(max(value / factor, 1e-4), min(value * factor, 1.0), _FINE_STEPS)


def _model_of(cost_model: CostModel, measurement: Measurement) -> CostModel:
    return measurement.cost_model or cost_model


def _errors(
    cost_model: CostModel, efficiency: Efficiency, samples: Sequence[Measurement]
) -> list[float]:
    """|predicted − measured| / measured per sample."""
    return [
        abs(p - s.seconds) / s.seconds
        for s, p in zip(samples, _predictions(cost_model, efficiency, samples), strict=True)
    ]


def _predictions(
    cost_model: CostModel, efficiency: Efficiency, samples: Sequence[Measurement]
) -> list[float]:
    models: dict[int, CostModel] = {}
    out = []
    for sample in samples:
        base = _model_of(cost_model, sample)
        if id(base) not in models:
            models[id(base)] = base.with_efficiency(efficiency)
        out.append(predict(models[id(base)], sample))
    return out


def predict(model: CostModel, measurement: Measurement) -> float:
    """Seconds `model` predicts for `measurement` (its steps, and its requests' overhead)."""
    if measurement.linear_only:
        return sum(
            count * model.layers_linear_s(sum(q.num_new_tokens for q in batch))
            for count, batch in measurement.steps
        )
    steps = sum(count * model.step_time(batch) for count, batch in measurement.steps)
    return steps + measurement.num_requests * model.efficiency.request_overhead_s


def overhead_counts(model: CostModel, measurement: Measurement) -> tuple[int, ...]:
    """How many times `measurement` pays each of `OVERHEADS`."""
    layers = model.model.num_layers * sum(
        count for count, batch in measurement.steps if any(q.num_new_tokens for q in batch)
    )
    if measurement.linear_only:
        return (0, 0, 0, layers)
    return (measurement.num_steps, measurement.num_seqs, measurement.num_requests, layers)


class _Terms:
    """Per-sample seconds at 100% of each peak, to evaluate a grid of efficiencies at once."""

    def __init__(
        self,
        cost_model: CostModel,
        samples: Sequence[Measurement],
        network: float,
        weights: np.ndarray,
        shape: Efficiency,
        memory: float | None,
    ) -> None:
        # The kernels' shape (roofline sharpness; KV reads unless searched), fixed.
        self.sharpness = shape.roofline_sharpness
        self.kv_read_amplification = shape.kv_read_amplification
        # The weights' bandwidth share where given (the grid's memory axis is then the KV
        # reads' share alone).
        self.memory = memory
        self.works = [
            self._work(_model_of(cost_model, s).with_efficiency(shape), s) for s in samples
        ]
        self.times = np.array([s.seconds for s in samples])
        # Communication at the given link efficiency: fixed, not searched.
        self.comm_s = np.array(
            [
                _comm_s(_model_of(cost_model, s).with_efficiency(Efficiency(network=network)), s)
                for s in samples
            ]
        )
        # Relative error, each sample scaled by its robustness weight.
        self.weights = weights / self.times
        # Overhead columns [k, OVERHEADS]: how often each sample pays each one.
        self.counts = np.array(
            [overhead_counts(_model_of(cost_model, s), s) for s in samples], dtype=float
        )

    @staticmethod
    def _work(model: CostModel, sample: Measurement):
        """(dense [steps, 4] with weights, attention [seqs, 4] with weights) at 100% peak:
        attention as (seconds of FLOPs, of KV read once, of KV written, KV group size)."""
        peak_flops, peak_attn = model.peak_linear_flops, model.peak_attention_flops
        bandwidth = model.hardware.memory_bandwidth
        dense, counts, attention = [], [], Counter()
        for count, batch in sample.steps:
            work = model.step_work(batch)
            head = (0.0, 0.0) if sample.linear_only else work.lm_head
            dense.append(
                (
                    work.linear[0] / peak_flops,
                    work.linear[1] / bandwidth,
                    head[0] / peak_flops,
                    head[1] / bandwidth,
                )
            )
            counts.append(count)
            for seq in () if sample.linear_only else batch:
                flops, read, written = model.attention_traffic(seq)
                key = (flops / peak_attn, read / bandwidth, written / bandwidth, model.kv_group)
                attention[key] += count
        att = np.array(list(attention), dtype=float).reshape(-1, 4)
        return (np.array(dense), np.array(counts, dtype=float)), (
            att,
            np.array(list(attention.values()), dtype=float),
        )

    def attention_s(self, attention: np.ndarray, memory: np.ndarray) -> np.ndarray:
        """[k, a, m]: attention seconds of sample k at efficiencies (a, m)."""
        return np.stack([self._attention(att, attention, memory) for _, att in self.works])

    def _attention(self, att, attention: np.ndarray, third: np.ndarray) -> np.ndarray:
        """[a, m] seconds at attention efficiencies `attention` and, on the third axis, the
        bandwidth share or (with `memory` given) 1 / the KV read amplification."""
        (items, counts), inv_a = att, 1 / attention
        if self.memory is None:
            inv_m, amplification = 1 / third, np.full_like(third, self.kv_read_amplification)
        else:
            inv_m, amplification = np.full_like(third, 1 / self.memory), 1 / third
        reads = np.minimum(amplification[None, :], items[:, 3, None])  # [items, m]
        memory_s = (items[:, 1, None] * reads + items[:, 2, None]) * inv_m[None, :]
        seconds = overlap(
            items[:, 0, None, None] * inv_a[None, :, None],
            memory_s[:, None, :],
            self.sharpness,
        )
        return np.tensordot(counts, seconds, axes=1)

    def search(
        self, linear: np.ndarray, attention: np.ndarray, memory: np.ndarray
    ) -> tuple[float, float, float, tuple[float, ...]]:
        """Best (linear, attention, memory, (each of OVERHEADS))."""
        # predicted[k, l, a, m]: roofline seconds of sample k at efficiencies (l, a, m).
        predicted = np.stack([self._roofline(w, linear, attention, memory) for w in self.works])
        weights = self.weights
        target = self.times - self.comm_s
        residual = (target[:, None, None, None] - predicted) * weights[:, None, None, None]
        overheads, loss = fit_overheads(residual, self.counts * weights[:, None])
        # The first grid point within rounding of the least loss (a flat valley's minimum
        # otherwise moves between CPUs).
        least = np.min(loss)
        index = np.unravel_index(
            np.flatnonzero(loss <= least + _TIE_TOLERANCE * abs(least))[0], loss.shape
        )
        return (
            float(linear[index[0]]),
            float(attention[index[1]]),
            float(memory[index[2]]),
            tuple(float(o[index]) for o in overheads),
        )

    def _roofline(self, work, linear, attention, memory) -> np.ndarray:
        (dense, counts), att = work
        inv_l = 1 / linear
        inv_m = 1 / (memory if self.memory is None else np.full_like(memory, self.memory))
        seconds = overlap(
            dense[:, 0, None, None] * inv_l[None, :, None],
            dense[:, 1, None, None] * inv_m[None, None, :],
            self.sharpness,
        ) + overlap(
            dense[:, 2, None, None] * inv_l[None, :, None],
            dense[:, 3, None, None] * inv_m[None, None, :],
            self.sharpness,
        )  # [steps, l, m]
        dense_s = np.tensordot(counts, seconds, axes=1)
        return dense_s[:, None, :] + self._attention(att, attention, memory)[None, :, :]


def _comm_s(model: CostModel, sample: Measurement) -> float:
    if sample.linear_only:
        return 0.0
    return sum(count * model.step_cost(batch).communication_s for count, batch in sample.steps)


def fit_overheads(residual: np.ndarray, columns: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Non-negative least squares of residual ≈ columns · overheads, per grid point.

    `residual` is [k, ...grid]; `columns` is [k, j] (the same at every grid point). Every
    subset of the j unknowns is solved by its normal equations and the best one with no
    negative value kept (exact for the few unknowns here). Returns the j overheads and the
    loss, each shaped like the grid.

    Where overheads are combinations of each other (on one model, per layer = per step ×
    its layers; with two models and all-reduces only on the larger, per layer, per step and
    per all-reduce are bound together), subsets that span the same columns fit exactly as
    well, and which one rounding favours differs between CPUs (their SIMD and BLAS paths).
    So a subset replaces the best only when it fits better by more than rounding: of equal
    fits, the one with the fewest terms, first in `OVERHEADS` order, is kept on every CPU.
    """
    # Each column scaled to unit length: counts run from 1 (requests) to 1e5 (sequences),
    # and unscaled normal equations would lose most of their digits.
    scale = np.linalg.norm(columns, axis=0)
    scale[scale == 0] = 1.0
    columns = columns / scale
    gram = columns.T @ columns
    projected = np.tensordot(columns.T, residual, axes=1)  # [j, ...grid]
    total = (residual**2).sum(axis=0)
    rounding = _TIE_TOLERANCE * total
    num_terms = columns.shape[1]
    best_loss = total.copy()
    best = [np.zeros_like(total) for _ in range(num_terms)]
    for size in range(1, num_terms + 1):
        for subset in itertools.combinations(range(num_terms), size):
            sub_gram = gram[np.ix_(subset, subset)]
            if abs(np.linalg.det(sub_gram)) <= 1e-12:
                continue  # an unknown no sample tells apart (e.g. no requests measured)
            values = np.tensordot(np.linalg.inv(sub_gram), projected[list(subset)], axes=1)
            loss = total - (values * projected[list(subset)]).sum(axis=0)
            better = (values >= 0).all(axis=0) & (loss < best_loss - rounding)
            best_loss = np.where(better, loss, best_loss)
            for i, term in enumerate(subset):
                best[term] = np.where(better, values[i], best[term])
            for term in set(range(num_terms)) - set(subset):
                best[term] = np.where(better, 0.0, best[term])
    return [b / s for b, s in zip(best, scale, strict=True)], best_loss


# An all-reduce's latency below this many GPUs follows another NCCL algorithm (two GPUs
# exchange directly): the link's one latency is fitted where tensor parallelism pays most.
LINK_FIT_MIN_GPUS = 4


@dataclass(frozen=True)
class LinkFit:
    """A link's measured latency and share of its line rate, from timed all-reduces."""

    latency_s: float
    efficiency: float
    # predicted / measured − 1 per point, in the order given (those not fitted too).
    residuals: tuple[float, ...]


def fit_link(line_bandwidth: float, points: Sequence[dict]) -> LinkFit:
    """Least squares (relative error) of a ring all-reduce, t = latency + 2(n−1)/n · bytes /
    (line_bandwidth · efficiency), over points {"num_gpus", "bytes", "seconds"} of at least
    `LINK_FIT_MIN_GPUS` GPUs."""
    rows = np.array(
        [
            [1.0, 2 * (p["num_gpus"] - 1) / p["num_gpus"] * p["bytes"] / line_bandwidth]
            for p in points
        ]
    )
    seconds = np.array([p["seconds"] for p in points])
    used = np.array([p["num_gpus"] >= LINK_FIT_MIN_GPUS for p in points])
    if used.sum() < 2:
        raise SimConfigError(f"a link fit needs 2 points of >= {LINK_FIT_MIN_GPUS} GPUs")
    design = rows / seconds[:, None]
    (latency, inverse_efficiency), *_ = np.linalg.lstsq(
        design[used], np.ones(int(used.sum())), rcond=None
    )
    residuals = tuple(float(r) for r in design @ [latency, inverse_efficiency] - 1)
    return LinkFit(float(latency), float(1 / inverse_efficiency), residuals)
