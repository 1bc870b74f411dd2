"""Phase-interference and overload detector: why were the token streams slow?

Two different problems make streams slow, and they have different fixes:
- **interference**: streams freeze while a long prompt is prefilled beside them (the case for
  chunked prefill or disaggregation);
- **overload**: more load than the server sustains; every stream is slow, prefill or not
  (the case for less load or more capacity).

Each output-token gap is judged against its own stream's pace at that time, not one global
median: the gap's *baseline* is the median of the `baseline_gaps` gaps of the same stream
nearest in time that do not overlap another request's long-prompt prefill (the run's such
gaps when the stream has too few). A short request's wait for its first token is its stream's
first gap (a chat that cannot start while a document prefills is frozen too), judged against
the median such wait clear of long prefills (the warm-up's, when fewer than three are). A gap
is a stall (a spike) when it exceeds `spike_factor` × its baseline; its excess over the
baseline is what it cost. A long prompt's prefill window
runs from its send time to its first token (or its end, if it produced none); a stall
coincides with a prefill when the two overlap and the stall is on another request's stream.
So an overloaded server's uniformly slow gaps are not stalls, and a freeze inside a prefill
stands out however slow the streams are around it.

Interference: stalled time is weighed, not spikes counted (one 10 s freeze behind a document
matters more than a dozen 150 ms hiccups), against chance (when long prefills are in flight
for most of the run, most stalls overlap one whatever their cause), and it must matter (a busy
host's 50 ms hiccups may all land inside prefills without costing anyone anything). Prefills
are stalling decodes when the share of stalled time inside their windows is at least
`min_fraction` and at least halfway from the windows' share of the run (chance) to all of it,
and those stalls' excess over their baselines is at least `min_slowdown` of all the time the
streams spent streaming.

Overload: the streams' pace outside long prefills (the time-weighted median gap: the pace at
which they spent half their streaming time) against what one step costs the server unloaded:
the median gap of the run's last warm-up request, sent alone before the run (or, without one,
the fastest pace the run itself sustained: the 10th percentile of the baselines). At least
`overload_factor` × slower is overload.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.workload.errors import BenchError
from pdserve.workload.records import RequestRecord

# A reference pace needs a few gaps to be a median.
_MIN_REFERENCE_GAPS = 3
# Without a warm-up, the run's fastest sustained pace: this percentile of its baselines.
_FASTEST_PACE_PERCENTILE = 10
WARMUP_REFERENCE = "one request alone before the run"
RUN_REFERENCE = "the fastest pace this run sustained"


@dataclass(frozen=True)
class InterferenceConfig:
    """`spike_factor`: a gap above this × its stream's baseline is a stall.
    `long_prompt_tokens`: a prompt at least this long counts as long. Interference when at
    least `min_spikes` stalls exist, the share of stalled time coinciding with long prefills
    is at least `min_fraction` and halfway from chance to certainty, and those stalls cost the
    streams at least `min_slowdown` of their time; overload when the streams' pace outside
    long prefills is at least `overload_factor` × the unloaded step (module doc).
    `baseline_gaps`: how many nearby gaps a baseline is the median of."""

    spike_factor: float = 3.0
    long_prompt_tokens: int = 1024
    min_spikes: int = 2
    min_fraction: float = 0.5
    min_slowdown: float = 0.05
    overload_factor: float = 3.0
    baseline_gaps: int = 15

    def __post_init__(self) -> None:
        if not self.spike_factor > 1.0:
            raise BenchError(f"--spike-factor must be > 1, got {self.spike_factor}")
        if self.long_prompt_tokens < 1:
            raise BenchError(f"--long-prompt-tokens must be >= 1, got {self.long_prompt_tokens}")
        if self.min_spikes < 1:
            raise BenchError(f"min_spikes must be >= 1, got {self.min_spikes}")
        if not 0.0 < self.min_fraction <= 1.0:
            raise BenchError(f"min_fraction must be in (0, 1], got {self.min_fraction}")
        if not 0.0 <= self.min_slowdown < 1.0:
            raise BenchError(f"min_slowdown must be in [0, 1), got {self.min_slowdown}")
        if not self.overload_factor > 1.0:
            raise BenchError(f"--overload-factor must be > 1, got {self.overload_factor}")
        if self.baseline_gaps < 1:
            raise BenchError(f"baseline_gaps must be >= 1, got {self.baseline_gaps}")


@dataclass(frozen=True)
class Spike:
    """One stalled gap on request `index`'s stream, seconds since the start; `baseline` is
    what the gap would have taken at its stream's pace."""

    index: int
    start: float
    end: float
    baseline: float
    is_in_prefill: bool
    # The wait from the request's send to its first token, not a gap between tokens.
    is_first_token: bool = False

    @property
    def gap_ms(self) -> float:
        return (self.end - self.start) * 1000.0

    @property
    def excess(self) -> float:
        return self.end - self.start - self.baseline


@dataclass(frozen=True)
class PrefillWindow:
    """A long prompt's prefill: request `index` from its send to its first token."""

    index: int
    start: float
    end: float


@dataclass(frozen=True)
class OverloadFinding:
    """The streams' pace outside long prefills against the server's unloaded step.
    `reference_ms` is None when neither a warm-up nor the run gives one."""

    pace_ms: float
    reference_ms: float | None
    reference_source: str
    factor: float

    @property
    def slowdown(self) -> float:
        return self.pace_ms / self.reference_ms if self.reference_ms else 0.0

    @property
    def is_overload(self) -> bool:
        return self.slowdown >= self.factor

    @property
    def verdict(self) -> str:
        if self.reference_ms is None:
            return "no unloaded pace to judge overload by"
        outcome = "overload" if self.is_overload else "not overloaded"
        return (
            f"outside long prefills the streams ran at {self.pace_ms:.0f} ms a token, "
            f"{self.slowdown:.1f}× the unloaded {self.reference_ms:.0f} ms "
            f"({self.reference_source}): {outcome}"
        )

    def to_dict(self) -> dict:
        return {
            "pace_ms": self.pace_ms,
            "unloaded_itl_ms": self.reference_ms,
            "unloaded_source": self.reference_source,
            "slowdown": self.slowdown,
            "overload_factor": self.factor,
            "is_overload": self.is_overload,
        }


@dataclass(frozen=True)
class InterferenceReport:
    """The detector's findings for one run (interference and overload), and its verdict."""

    config: InterferenceConfig
    median_itl_ms: float
    # Gaps between tokens, and short requests' waits for their first token.
    num_gaps: int
    # Sum of all those: the time the streams spent waiting for tokens.
    streamed_s: float
    spikes: tuple[Spike, ...]
    windows: tuple[PrefillWindow, ...]
    overload: OverloadFinding
    # The run's span (first send to last token), seconds since the start.
    span: tuple[float, float] = (0.0, 0.0)

    @property
    def spike_threshold_ms(self) -> float:
        """A typical stall threshold: `spike_factor` × the median of the stalls' baselines
        (of every gap's, when there are no stalls). For plots; each gap has its own."""
        baselines = [s.baseline for s in self.spikes]
        median_s = float(np.median(baselines)) if baselines else self.median_itl_ms / 1000.0
        return self.config.spike_factor * median_s * 1000.0

    @property
    def num_spikes(self) -> int:
        return len(self.spikes)

    @property
    def num_in_prefill(self) -> int:
        return sum(s.is_in_prefill for s in self.spikes)

    @property
    def spike_fraction(self) -> float:
        """Share of all gaps that are stalls."""
        return self.num_spikes / self.num_gaps if self.num_gaps else 0.0

    @property
    def stalled_s(self) -> float:
        return sum(s.end - s.start for s in self.spikes)

    @property
    def in_prefill_fraction(self) -> float:
        """Share of stalled time in stalls that coincide with a long prompt's prefill."""
        stalled = self.stalled_s
        in_prefill = sum(s.end - s.start for s in self.spikes if s.is_in_prefill)
        return in_prefill / stalled if stalled > 0 else 0.0

    @property
    def prefill_slowdown(self) -> float:
        """Share of streaming time lost to stalls inside long prefills: each such stall's
        excess over its baseline, over the sum of all gaps."""
        excess = sum(s.excess for s in self.spikes if s.is_in_prefill)
        return excess / self.streamed_s if self.streamed_s > 0 else 0.0

    @property
    def window_coverage(self) -> float:
        """Share of the run during which some long prompt is prefilling: the share of
        stalled time that would coincide by chance."""
        start, end = self.span
        if end <= start:
            return 0.0
        covered, reach = 0.0, start
        for w in sorted(self.windows, key=lambda w: w.start):
            low, high = max(w.start, reach, start), min(w.end, end)
            if high > low:
                covered += high - low
            reach = max(reach, w.end)
        return covered / (end - start)

    @property
    def required_fraction(self) -> float:
        """The in-prefill share that counts as interference: halfway from chance to all."""
        chance = self.window_coverage
        return max(self.config.min_fraction, chance + (1.0 - chance) / 2)

    @property
    def is_interference(self) -> bool:
        return (
            self.num_spikes >= self.config.min_spikes
            and self.in_prefill_fraction >= self.required_fraction
            and self.prefill_slowdown >= self.config.min_slowdown
        )

    @property
    def is_overload(self) -> bool:
        return self.overload.is_overload

    @property
    def finding(self) -> str:
        """ "interference", "overload", "both" or "neither"."""
        if self.is_interference and self.is_overload:
            return "both"
        if self.is_interference:
            return "interference"
        return "overload" if self.is_overload else "neither"

    @property
    def interference_verdict(self) -> str:
        k = f"{self.config.spike_factor:g}×"
        if not self.spikes:
            return f"no stalls (gaps above {k} their stream's pace): no phase interference"
        if not self.windows:
            return (
                f"{self.num_spikes} stalls but no long prompts "
                f"(>= {self.config.long_prompt_tokens} tokens): not phase interference"
            )
        outcome = "phase interference" if self.is_interference else "no phase interference"
        starts = sum(s.is_first_token for s in self.spikes)
        of_them = f", {starts} of them before a first token" if starts else ""
        return (
            f"{self.in_prefill_fraction:.0%} of stalled time falls in long-prompt prefills, "
            f"which cover {self.window_coverage:.0%} of the run, and costs the streams "
            f"{self.prefill_slowdown:.1%} of their time: {outcome} ({self.num_in_prefill} of "
            f"{self.num_spikes} stalls above {k} their stream's pace{of_them}; "
            f"{self.spike_fraction:.1%} of all gaps)"
        )

    @property
    def verdict(self) -> str:
        """One line: the finding, then the evidence for each half, e.g. "Interference: 87% of
        stalled time falls in long-prompt prefills ...; outside long prefills ..."."""
        return f"{self.finding.capitalize()}: {self.interference_verdict}; {self.overload.verdict}."

    def to_dict(self) -> dict:
        return {
            "finding": self.finding,
            "median_itl_ms": self.median_itl_ms,
            "spike_threshold_ms": self.spike_threshold_ms,
            "num_gaps": self.num_gaps,
            "num_spikes": self.num_spikes,
            "num_spikes_in_prefill": self.num_in_prefill,
            "spike_fraction": self.spike_fraction,
            "in_prefill_fraction": self.in_prefill_fraction,
            "stalled_s": self.stalled_s,
            "window_coverage": self.window_coverage,
            "prefill_slowdown": self.prefill_slowdown,
            "num_long_prompts": len(self.windows),
            "is_interference": self.is_interference,
            "overload": self.overload.to_dict(),
            "is_overload": self.is_overload,
            "verdict": self.verdict,
        }


def prefill_windows(records: list[RequestRecord], long_prompt_tokens: int) -> list[PrefillWindow]:
    """Prefill windows of every sent request whose prompt is long."""
    windows = []
    for r in records:
        end = r.first_token_time if r.first_token_time is not None else r.end_time
        if r.prompt_len >= long_prompt_tokens and r.send_time is not None and end is not None:
            windows.append(PrefillWindow(r.index, r.send_time, end))
    return windows


@dataclass(frozen=True)
class _Gap:
    index: int
    start: float
    end: float
    is_in_prefill: bool

    @property
    def length(self) -> float:
        return self.end - self.start

    @property
    def middle(self) -> float:
        return (self.start + self.end) / 2


class _Baselines:
    """Median of the `k` gaps outside long prefills nearest in time, from one pool."""

    def __init__(self, gaps: list[_Gap], k: int) -> None:
        clear = sorted((g for g in gaps if not g.is_in_prefill), key=lambda g: g.middle)
        self.middles = np.array([g.middle for g in clear])
        self.lengths = np.array([g.length for g in clear])
        self.k = k

    def __len__(self) -> int:
        return len(self.lengths)

    def at(self, t: float) -> float:
        # The k consecutive clear gaps (in time) centred on t: nearly the k nearest.
        i = int(np.searchsorted(self.middles, t))
        low = max(0, min(i - self.k // 2, len(self) - self.k))
        return float(np.median(self.lengths[low : low + self.k]))


def detect_interference(
    records: list[RequestRecord],
    config: InterferenceConfig | None = None,
    unloaded: Sequence[RequestRecord] = (),
) -> InterferenceReport:
    """Judge every token gap against its stream's pace, and line the stalls up with the long
    prefills in flight; judge the pace against `unloaded` (warm-up requests sent alone before
    the run, the last one with enough tokens counts) or the run's own fastest pace."""
    config = config or InterferenceConfig()
    windows = prefill_windows(records, config.long_prompt_tokens)
    gaps = [
        _Gap(r.index, a, b, _overlaps_other(r.index, a, b, windows))
        for r in records
        for a, b in itertools.pairwise(r.token_times)
    ]
    lengths = [g.length for g in gaps]
    median_s = float(np.median(lengths)) if gaps else 0.0
    baseline = _baseline_function(gaps, config.baseline_gaps, median_s)
    spikes, baselines = [], []
    for g in gaps:
        base = baseline(g)
        baselines.append(base)
        if g.length > config.spike_factor * base:
            spikes.append(Spike(g.index, g.start, g.end, base, g.is_in_prefill))
    waits = [
        _Gap(r.index, r.send_time, r.first_token_time, _overlaps_other(r.index, *w, windows))
        for r in records
        if r.prompt_len < config.long_prompt_tokens
        and (w := (r.send_time, r.first_token_time))[0] is not None
        and w[1] is not None
    ]
    wait_base = _wait_baseline(waits, unloaded)
    spikes += [
        Spike(w.index, w.start, w.end, wait_base, w.is_in_prefill, is_first_token=True)
        for w in waits
        if wait_base and w.length > config.spike_factor * wait_base
    ]
    times = [t for r in records for t in (r.send_time, *r.token_times) if t is not None]
    span = (min(times), max(times)) if times else (0.0, 0.0)
    overload = _overload(gaps, baselines, unloaded, config.overload_factor)
    return InterferenceReport(
        config,
        median_s * 1000.0,
        len(gaps) + len(waits),
        sum(lengths) + sum(w.length for w in waits),
        tuple(spikes),
        tuple(windows),
        overload,
        span,
    )


def _wait_baseline(waits: list[_Gap], unloaded: Sequence[RequestRecord]) -> float | None:
    """A short request's usual wait for its first token: the median of those clear of long
    prefills, else the last warm-up's."""
    clear = [w.length for w in waits if not w.is_in_prefill]
    if len(clear) >= _MIN_REFERENCE_GAPS:
        return float(np.median(clear))
    return next((r.ttft for r in reversed(unloaded) if r.success), None)


def _baseline_function(gaps: list[_Gap], k: int, fallback_s: float):
    """gap -> its baseline: its stream's clear gaps nearby, else the run's, else the median."""
    by_stream = {
        index: _Baselines(list(group), k)
        for index, group in itertools.groupby(gaps, key=lambda g: g.index)
    }
    run = _Baselines(gaps, k)

    def baseline(gap: _Gap) -> float:
        own = by_stream[gap.index]
        pool = own if len(own) >= _MIN_REFERENCE_GAPS else run
        return pool.at(gap.middle) if len(pool) else fallback_s

    return baseline


def _overload(
    gaps: list[_Gap], baselines: list[float], unloaded: Sequence[RequestRecord], factor: float
) -> OverloadFinding:
    clear = [(g.length, b) for g, b in zip(gaps, baselines, strict=True) if not g.is_in_prefill]
    pace_s = _time_weighted_median([length for length, _ in clear])
    reference_s = next(
        (
            float(np.median(r.itls))
            for r in reversed(unloaded)
            if r.success and len(r.itls) >= _MIN_REFERENCE_GAPS
        ),
        None,
    )
    source = WARMUP_REFERENCE
    if reference_s is None and clear:
        reference_s = float(np.percentile([b for _, b in clear], _FASTEST_PACE_PERCENTILE))
        source = RUN_REFERENCE
    if not reference_s:
        reference_s, source = None, ""
    reference_ms = None if reference_s is None else reference_s * 1000.0
    return OverloadFinding(pace_s * 1000.0, reference_ms, source, factor)


def _time_weighted_median(lengths: list[float]) -> float:
    """The gap length at which half of the summed time lies in gaps at most that long."""
    if not lengths:
        return 0.0
    ordered = np.sort(np.asarray(lengths))
    cumulative = np.cumsum(ordered)
    return float(ordered[np.searchsorted(cumulative, cumulative[-1] / 2)])


def _overlaps_other(index: int, start: float, end: float, windows: list[PrefillWindow]) -> bool:
    return any(w.index != index and start < w.end and end > w.start for w in windows)
