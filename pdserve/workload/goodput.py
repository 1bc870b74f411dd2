"""Goodput as DistServe defines it, from the runs that measured it: the highest request rate
at which a target share of requests (`attainment`, 90% by default) meets every SLO.

A rate with several runs (seeds) counts as met only where every run met the target, as missed
only where every run missed it; where they disagree it lies between the answer and its bound.
So [max_rate, min_missed_rate) is an interval that one lucky or unlucky run cannot shrink.
The load generator's search (`pdserve.bench.search`) and the simulator's re-prediction of it
(`pdserve.sim.scale`) judge their runs by this one rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.workload.errors import BenchError
from pdserve.workload.records import STOPPED_EARLY
from pdserve.workload.run import BenchResult

DEFAULT_ATTAINMENT = 0.9
# A search run at a low rate still has this many requests (its attainment means something).
MIN_SEARCH_PROMPTS = 10


def sustained_count(num_prompts: int, base_rate: float, rate: float) -> int:
    """A search run's request count at `rate`: as many as keep the span of the first run
    (`num_prompts` at `base_rate`), so that the rate is sustained, not a burst the server
    absorbs and drains; at least `MIN_SEARCH_PROMPTS`."""
    return max(MIN_SEARCH_PROMPTS, round(num_prompts * rate / base_rate))


@dataclass(frozen=True)
class SearchPoint:
    """One run of the search: how many of its requests met every SLO at `rate`."""

    rate: float
    num_good: int
    num_requests: int
    goodput: float = 0.0
    is_stopped_early: bool = False
    seed: int | None = None

    @property
    def attainment(self) -> float:
        return self.num_good / self.num_requests if self.num_requests else 0.0

    @classmethod
    def of(cls, result: BenchResult) -> SearchPoint:
        m = result.metrics
        if m.num_good is None or result.request_rate is None:
            raise BenchError("a rate search needs --goodput SLOs and a finite --request-rate")
        return cls(
            rate=result.request_rate,
            num_good=m.num_good,
            num_requests=len(result.records),
            goodput=m.request_goodput or 0.0,
            is_stopped_early=any(r.error == STOPPED_EARLY for r in result.records),
            seed=result.spec.seed,
        )


@dataclass(frozen=True)
class SearchResult:
    """The points a search ran, in order, and why it stopped."""

    attainment: float
    points: tuple[SearchPoint, ...]
    stop_reason: str = ""

    def meets(self, point: SearchPoint) -> bool:
        return point.attainment >= self.attainment - 1e-9

    def _verdicts(self) -> dict[float, set[bool]]:
        """Each rate tried: whether its runs met the target (both: they disagree)."""
        verdicts: dict[float, set[bool]] = {}
        for p in self.points:
            verdicts.setdefault(p.rate, set()).add(self.meets(p))
        return verdicts

    @property
    def min_missed_rate(self) -> float | None:
        """The lowest rate every run of which missed the target: the search's upper bound."""
        missed = [rate for rate, met in self._verdicts().items() if met == {False}]
        return min(missed) if missed else None

    @property
    def max_rate(self) -> float | None:
        """The highest rate every run of which met the target, below the lowest missed
        (None: no searched rate did): the goodput in DistServe's sense."""
        bound = self.min_missed_rate
        met = [
            rate
            for rate, verdict in self._verdicts().items()
            if verdict == {True} and (bound is None or rate < bound)
        ]
        return max(met) if met else None

    @property
    def uncertain_rates(self) -> list[float]:
        """Rates at which the seeds disagree."""
        return sorted(rate for rate, met in self._verdicts().items() if len(met) > 1)

    @property
    def num_seeds(self) -> int:
        return max(1, len({p.seed for p in self.points}))

    @property
    def min_rate(self) -> float:
        return min(p.rate for p in self.points)

    def describe(self) -> str:
        """E.g. "0.71 req/s (missed at 1)", "none down to 0.06 req/s", ">= 4 req/s"."""
        best, bound = self.max_rate, self.min_missed_rate
        disagree = ", ".join(f"{r:.3g}" for r in self.uncertain_rates)
        seeds = f"; {self.num_seeds} seeds disagree at {disagree}" if disagree else ""
        if best is None:
            return f"none down to {self.min_rate:.3g} req/s{seeds}"
        if bound is None:
            return f">= {best:.3g} req/s (met at every searched rate{seeds})"
        return f"{best:.3g} req/s (missed at {bound:.3g}{seeds})"

    def to_dict(self) -> dict:
        return {
            "slo_attainment": self.attainment,
            "max_rate": self.max_rate,
            "min_missed_rate": self.min_missed_rate,
            "num_seeds": self.num_seeds,
            "stop_reason": self.stop_reason,
            "points": [{**asdict(p), "attainment": p.attainment} for p in self.points],
        }
