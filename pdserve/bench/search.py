"""Goodput as DistServe defines it: the highest request rate at which a target share of
requests (`attainment`, 90% by default) meets every SLO.

A short search per server, on the sweep's machinery (the same workload and seed, one server
kept up throughout): from the first rate, multiply by `growth` while the target is met (divide
while it is not) until the rate is bracketed, then bisect the bracket geometrically until its
two ends are within `step` of each other. Every run offers its rate for as long as the first
run did (the workload's request count scaled with the rate, where it has one): a rate is
sustained, not a burst the server absorbs and drains. Bounded: at most `max_runs` runs besides
the first, none started that would end after `budget_s` (judged by the last run's length,
longer in proportion for a lower rate: a run's request count has a floor),
none below `min_rate_ratio` × the first rate. A run whose outcome is decided (more requests
missed an SLO than the target allows) stops early. The answer is the highest rate met below
the lowest rate missed, so one noisy run above a miss cannot raise it.

Then `repeat_boundary` runs the two rates that decide the answer (the highest met, the lowest
missed) again with other seeds (other requests, other arrival times), within the same
budget. A rate with several runs counts as met only where every run met the target, as
missed only where every run missed it; where they disagree it lies between the answer and
its bound. So [max_rate, min_missed_rate) is an interval that one lucky or unlucky run
cannot shrink: the noise of a few dozen requests per run widens it instead. The rule and the
runs' sizes live in `pdserve.workload.goodput`: the simulator re-predicts a search by them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.bench.runner import StopWhen
from pdserve.workload.errors import BenchError
from pdserve.workload.goodput import DEFAULT_ATTAINMENT, SearchPoint, SearchResult
from pdserve.workload.metrics import has_missed_slos
from pdserve.workload.records import RequestRecord


@dataclass(frozen=True)
class RateSearch:
    """How to search each server's highest rate meeting the SLOs (module doc)."""

    attainment: float = DEFAULT_ATTAINMENT
    step: float = 1.25
    max_runs: int = 5
    budget_s: float | None = None
    growth: float = 2.0
    min_rate_ratio: float = 1 / 16

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment <= 1.0:
            raise BenchError(f"--slo-attainment must be in (0, 1], got {self.attainment}")
        if not self.step > 1.0:
            raise BenchError(f"--search-step must be > 1, got {self.step}")
        if self.max_runs < 1:
            raise BenchError(f"--search-max-runs must be >= 1, got {self.max_runs}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise BenchError(f"--search-budget must be > 0 seconds, got {self.budget_s}")
        if not self.growth > self.step:
            raise BenchError(f"search growth {self.growth} must exceed its step {self.step}")
        if not 0.0 < self.min_rate_ratio < 1.0:
            raise BenchError(f"min_rate_ratio must be in (0, 1), got {self.min_rate_ratio}")

    def is_hopeless(self, slos: Mapping[str, float]) -> StopWhen:
        """`stop_when` for one run: more requests already missed an SLO than the target
        allows."""

        def hopeless(records: list[RequestRecord], now: float) -> bool:
            allowed = math.floor(len(records) * (1.0 - self.attainment) + 1e-9)
            return sum(has_missed_slos(r, slos, now) for r in records) > allowed

        return hopeless


async def search_max_rate(
    first: SearchPoint,
    measure: Callable[[float], Awaitable[SearchPoint]],
    config: RateSearch,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult:
    """Search from the already-measured `first` point, calling `measure(rate)` for each new
    one (module doc)."""
    points = [first]
    started = clock()
    last_run_s, last_rate = 0.0, first.rate
    while True:
        rate, reason = _next_rate(SearchResult(config.attainment, tuple(points)), first, config)
        if rate is None:
            break
        if len(points) > config.max_runs:
            reason = f"run limit ({config.max_runs} runs besides the first)"
            break
        now = clock()
        expected_s = last_run_s * max(1.0, last_rate / rate)
        if config.budget_s is not None and now - started + expected_s > config.budget_s:
            reason = f"time budget ({config.budget_s:.3g} s)"
            break
        points.append(await measure(rate))
        last_run_s, last_rate = clock() - now, rate
    return SearchResult(config.attainment, tuple(points), reason)


def _next_rate(
    so_far: SearchResult, first: SearchPoint, config: RateSearch
) -> tuple[float | None, str]:
    low, high = so_far.max_rate, so_far.min_missed_rate
    if low is None:
        rate = so_far.min_rate / config.growth
        floor = first.rate * config.min_rate_ratio
        if rate < floor * (1 - 1e-9):
            return None, f"no rate met down to {so_far.min_rate:.3g} req/s"
        return rate, ""
    if high is None:
        return low * config.growth, ""
    if high / low <= config.step * (1 + 1e-9):
        return None, f"bracketed within {config.step:g}x"
    return math.sqrt(low * high), ""


async def repeat_boundary(
    result: SearchResult,
    measure: Callable[[float, int], Awaitable[SearchPoint]],
    seeds: Sequence[int],
    config: RateSearch,
    started: float,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult:
    """`result` with its deciding rates (the highest met, the lowest missed) run again at
    each of `seeds` by `measure(rate, seed)`, none started that would end after
    `config.budget_s` from `started` (module doc)."""
    rates = [r for r in (result.max_rate, result.min_missed_rate) if r is not None]
    if not rates:
        rates = [result.min_rate]  # nothing met: is the lowest rate a miss at every seed?
    points, reason = list(result.points), result.stop_reason
    last_run_s = 0.0
    for seed in seeds:
        for rate in rates:
            now = clock()
            if config.budget_s is not None and now - started + last_run_s > config.budget_s:
                done = len({p.seed for p in points}) - 1
                note = f"time budget ({config.budget_s:.3g} s) after {done} more seeds"
                return SearchResult(config.attainment, tuple(points), f"{reason}; {note}")
            points.append(await measure(rate, seed))
            last_run_s = clock() - now
    return SearchResult(config.attainment, tuple(points), reason)
