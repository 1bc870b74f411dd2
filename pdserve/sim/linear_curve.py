"""`Efficiency.linear_curve`: measured linear-layer time against the row count, and its fit.

A curve is (rows, seconds per parameter) knots with rows increasing; a layer of P parameters
over M rows takes P × curve(M), linear between knots, constant below the first and growing in
proportion to M past the last (compute-bound). Evaluation and fitting share `hat_weights`, so
what is fitted is exactly what the cost model evaluates.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pdserve.sim.calibration import StepSample
    from pdserve.sim.cost_model import CostModel

Curve = tuple[tuple[int, float], ...]
# Knots: every row count up to 16 (kernels switch among small batches), then steps of 1.5x.
_SMALL_ROWS = 16
_KNOT_GROWTH = 1.5
# A knot one sample alone decides would fit that sample's noise (or disturbance) exactly.
_MIN_KNOT_SAMPLES = 3


def hat_weights(knots: Sequence[int], rows: int) -> list[tuple[int, float]]:
    """(knot index, weight) pairs whose weighted knot values give the curve at `rows`."""
    index = bisect.bisect_left(knots, rows)
    if index < len(knots) and knots[index] == rows:
        return [(index, 1.0)]
    if index == 0:
        return [(0, 1.0)]
    if index == len(knots):
        return [(index - 1, rows / knots[-1])]
    low, high = knots[index - 1], knots[index]
    fraction = (rows - low) / (high - low)
    return [(index - 1, 1 - fraction), (index, fraction)]


def seconds_per_param(curve: Curve, rows: int) -> float:
    """Seconds per parameter of a linear layer over `rows` rows, from a non-empty curve."""
    knots = [m for m, _ in curve]
    return sum(curve[i][1] * weight for i, weight in hat_weights(knots, rows))


class CurveFit:
    """Least squares for a curve and the per-sequence overhead, given attention seconds.

    The curve absorbs any fixed per-step cost (a constant is indistinguishable from linear
    time at a row count). `scale` weighs each sample's residual (1 / its time: relative
    error, times a robustness weight); `attention_s(attention, memory)` gives every sample's
    attention seconds [k] at those efficiencies.
    """

    def __init__(
        self,
        cost_model: CostModel,
        samples: Sequence[StepSample],
        scale: np.ndarray,
        attention_s: Callable[[float, float], np.ndarray],
    ) -> None:
        self.times = np.array([s.step_s for s in samples])
        self.layer_rows = [sum(q.num_new_tokens for q in s.batch) for s in samples]
        self.head_rows = [sum(q.is_sampling for q in s.batch) for s in samples]
        self.num_seqs = np.array([len(s.batch) for s in samples], dtype=float)
        self.params = (cost_model.layer_params, cost_model.head_params)
        self.scale = scale
        self.attention_s = attention_s
        self.knots, self.design = self._select_knots()

    @property
    def is_possible(self) -> bool:
        """Enough samples for more than one per unknown."""
        return self.knots is not None

    def _select_knots(self) -> tuple[list[int] | None, np.ndarray | None]:
        """Candidate knots up to the largest row count, less those fewer than
        `_MIN_KNOT_SAMPLES` samples inform (repeated until all are); None when too few."""
        largest = max(self.layer_rows)
        knots = list(range(1, min(largest, _SMALL_ROWS) + 1))
        while knots[-1] < largest:
            knots.append(max(knots[-1] + 1, round(knots[-1] * _KNOT_GROWTH)))
        while True:
            design = self._design(knots)
            used = (design[:, :-1] != 0).sum(axis=0) >= _MIN_KNOT_SAMPLES
            if used.all():
                break
            knots = [k for k, keep in zip(knots, used, strict=True) if keep]
        if len(self.layer_rows) <= len(knots) + 1:
            return None, None
        return knots, design

    def _design(self, knots: list[int]) -> np.ndarray:
        """[k, knots + 1]: seconds per unit of each knot's value, then of per-seq overhead."""
        layer_params, head_params = self.params
        columns = np.zeros((len(self.layer_rows), len(knots) + 1))
        for i, (rows, sampled) in enumerate(zip(self.layer_rows, self.head_rows, strict=True)):
            for params, count in ((layer_params, rows), (head_params, sampled)):
                if count:
                    for knot, weight in hat_weights(knots, count):
                        columns[i, knot] += params * weight
        columns[:, -1] = self.num_seqs
        return columns * self.scale[:, None]

    def solve(self, attention: float, memory: float) -> tuple[Curve, float]:
        """The curve and per-seq overhead at (attention, memory), every value positive: a
        knot fitted non-positive is dropped (its neighbours interpolate over it), and a
        negative per-seq overhead is fixed at zero. (Where every step is a decode, sequences
        and rows are the same count and only this keeps the two apart.)"""
        target = (self.times - self.attention_s(attention, memory)) * self.scale
        knots, design, has_per_seq = self.knots, self.design, True
        while True:
            columns = design if has_per_seq else design[:, :-1]
            # Columns scaled to unit norm: knots at many rows and the per-seq count differ
            # by orders of magnitude.
            norms = np.linalg.norm(columns, axis=0)
            values = np.linalg.lstsq(columns / norms, target, rcond=None)[0] / norms
            curve_values, per_seq = values[: len(knots)], values[-1] if has_per_seq else 0.0
            keep = curve_values > 0
            if (keep.all() and per_seq >= 0) or not keep.any():
                break
            has_per_seq = has_per_seq and per_seq >= 0
            if not keep.all():
                knots = [k for k, ok in zip(knots, keep, strict=True) if ok]
                design = self._design(knots)
        curve = tuple((k, float(v)) for k, v in zip(knots, curve_values, strict=True) if v > 0)
        return curve, max(float(per_seq), 0.0)
