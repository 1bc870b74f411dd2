"""`Efficiency.linear_curve`: measured linear-layer time against the row count, and its fit.

A curve is (rows, seconds per parameter) knots with rows increasing; a layer of P parameters
over M rows takes P × curve(M), linear between knots, constant below the first and growing in
proportion to M past the last (compute-bound). Evaluation and fitting share `hat_weights`, so
what is fitted is exactly what the cost model evaluates.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

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
    """Least squares for a curve and overheads, given the other seconds (attention,
    communication).

    The curve absorbs any fixed per-step cost (a constant is indistinguishable from linear
    time at a row count). `scale` weighs each sample's residual (1 / its time: relative
    error, times a robustness weight); `fixed_s(attention, memory)` gives every sample's
    seconds outside the linear layers [k] at those efficiencies. Per sample: `times` [k] its
    measured seconds, `steps` its steps as (how many times, layer rows, head rows), `params`
    its (layer, head) parameter counts per device; `overheads` [k, j] how often each sample
    pays each of j overheads fitted beside the curve.
    """

    def __init__(
        self,
        times: np.ndarray,
        steps: Sequence[Sequence[tuple[int, int, int]]],
        params: Sequence[tuple[int, int]],
        overheads: np.ndarray,
        scale: np.ndarray,
        fixed_s: Callable[[float, float], np.ndarray],
    ) -> None:
        self.times = times
        self.steps = steps
        self.params = params
        self.overheads = overheads
        self.scale = scale
        self.fixed_s = fixed_s
        self.knots, self.design = self._select_knots()

    @property
    def is_possible(self) -> bool:
        """Enough samples for more than one per unknown."""
        return self.knots is not None

    def _select_knots(self) -> tuple[list[int] | None, np.ndarray | None]:
        """Candidate knots up to the largest row count, less those fewer than
        `_MIN_KNOT_SAMPLES` samples inform (repeated until all are); None when too few."""
        largest = max(rows for steps in self.steps for _, rows, _ in steps)
        knots = list(range(1, min(largest, _SMALL_ROWS) + 1))
        while knots[-1] < largest:
            knots.append(max(knots[-1] + 1, round(knots[-1] * _KNOT_GROWTH)))
        while True:
            design = self._design(knots)
            used = (design[:, : len(knots)] != 0).sum(axis=0) >= _MIN_KNOT_SAMPLES
            if used.all():
                break
            knots = [k for k, keep in zip(knots, used, strict=True) if keep]
        if len(self.steps) <= len(knots) + self.overheads.shape[1]:
            return None, None
        return knots, design

    def _design(self, knots: list[int]) -> np.ndarray:
        """[k, knots + j]: seconds per unit of each knot's value, then of each overhead."""
        columns = np.zeros((len(self.steps), len(knots) + self.overheads.shape[1]))
        for i, (steps, (layer_params, head_params)) in enumerate(
            zip(self.steps, self.params, strict=True)
        ):
            for count, rows, sampled in steps:
                for params, num in ((layer_params, rows), (head_params, sampled)):
                    if num:
                        for knot, weight in hat_weights(knots, num):
                            columns[i, knot] += count * params * weight
        columns[:, len(knots) :] = self.overheads
        return columns * self.scale[:, None]

    def solve(self, attention: float, memory: float) -> tuple[Curve, list[float], float]:
        """The curve and the overheads at (attention, memory), every value positive: a knot
        fitted non-positive is dropped (its neighbours interpolate over it), and a negative
        overhead is fixed at zero. (Where every step is a decode, sequences and rows are the
        same count and only this keeps the two apart.) Also returns the leave-one-out loss:
        the sum of squared scaled residuals, each sample predicted without itself, which
        tells a curve that follows the measurements from one that only fits those few
        points (a knot that a single sample decides predicts it perfectly, and nothing
        else)."""
        target = (self.times - self.fixed_s(attention, memory)) * self.scale
        knots, design = self.knots, self.design
        has_overhead = [bool(column.any()) for column in self.overheads.T]
        while True:
            keep_columns = [True] * len(knots) + has_overhead
            columns = design[:, keep_columns]
            # Columns scaled to unit norm: knots at many rows and the per-seq count differ
            # by orders of magnitude.
            norms = np.linalg.norm(columns, axis=0)
            unit = columns / norms
            values = np.linalg.lstsq(unit, target, rcond=None)[0] / norms
            curve_values, rest = values[: len(knots)], list(values[len(knots) :])
            overheads = [rest.pop(0) if has else 0.0 for has in has_overhead]
            keep = curve_values > 0
            if (keep.all() and min(overheads) >= 0) or not keep.any():
                break
            has_overhead = [
                has and value >= 0 for has, value in zip(has_overhead, overheads, strict=True)
            ]
            if not keep.all():
                knots = [k for k, ok in zip(knots, keep, strict=True) if ok]
                design = self._design(knots)
        curve = tuple((k, float(v)) for k, v in zip(knots, curve_values, strict=True) if v > 0)
        # Leave-one-out residuals of a linear least-squares fit: r / (1 − leverage).
        leverage = (np.linalg.qr(unit)[0] ** 2).sum(axis=1)
        residual = target - columns @ values
        loo = residual / np.maximum(1 - leverage, 1e-9)
        return curve, [max(float(value), 0.0) for value in overheads], float(np.sum(loo**2))
