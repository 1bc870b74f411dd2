"""`Histogram`: a latency histogram as Prometheus exports it, and as the planner reads it:
observations since the last tick (bucket deltas), pooled over workers, and their quantiles
(as Prometheus' ``histogram_quantile``). `HistogramRecorder` counts the simulator's into the
same buckets."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass


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
