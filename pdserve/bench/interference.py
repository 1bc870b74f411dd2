"""Phase-interference detector: do token stalls line up with long prompts' prefills?

Every output-token gap of every stream is a spike when it exceeds `spike_factor` × the median
ITL of the run; its length is stalled time. A long prompt's prefill window runs from its send
time to its first token (or its end, if it produced none). A spike coincides with a prefill
when the two intervals overlap and the spike is on another request's stream.

Stalled time is weighed, not spikes counted: one 10 s freeze behind a document matters more
than a dozen 150 ms hiccups. And it is weighed against chance: when long prefills are in
flight for most of the run (queued behind a busy prefill pool, say), most stalls overlap one
whether or not they cause it. And it must matter: a few 50 ms scheduling hiccups on a busy
host may all land inside prefills without costing anyone anything. Prefills are stalling
decodes — phase interference, the case for chunked prefill or disaggregation — when the share
of stalled time inside their windows is at least `min_fraction` and at least halfway from the
windows' share of the run (chance) to all of it, and those stalls' excess over the median gap
is at least `min_slowdown` of all the time the streams spent streaming.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pdserve.bench.errors import BenchError
from pdserve.bench.records import RequestRecord


@dataclass(frozen=True)
class InterferenceConfig:
    """`spike_factor`: a gap above this × median ITL is a spike. `long_prompt_tokens`: a
    prompt at least this long counts as long. The verdict is "phase interference" when at
    least `min_spikes` spikes exist and the share of stalled time coinciding with long
    prefills is at least `min_fraction` and halfway from chance to certainty, and those stalls
    cost the streams at least `min_slowdown` of their time (module doc)."""

    spike_factor: float = 3.0
    long_prompt_tokens: int = 1024
    min_spikes: int = 2
    min_fraction: float = 0.5
    min_slowdown: float = 0.05

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


@dataclass(frozen=True)
class Spike:
    """One stalled gap on request `index`'s stream, seconds since the start."""

    index: int
    start: float
    end: float
    is_in_prefill: bool

    @property
    def gap_ms(self) -> float:
        return (self.end - self.start) * 1000.0


@dataclass(frozen=True)
class PrefillWindow:
    """A long prompt's prefill: request `index` from its send to its first token."""

    index: int
    start: float
    end: float


@dataclass(frozen=True)
class InterferenceReport:
    """The detector's findings for one run, and its one-line verdict."""

    config: InterferenceConfig
    median_itl_ms: float
    num_gaps: int
    # Sum of every gap of every stream: the time the streams spent streaming.
    streamed_s: float
    spikes: tuple[Spike, ...]
    windows: tuple[PrefillWindow, ...]
    # The run's span (first send to last token), seconds since the start.
    span: tuple[float, float] = (0.0, 0.0)

    @property
    def spike_threshold_ms(self) -> float:
        return self.config.spike_factor * self.median_itl_ms

    @property
    def num_spikes(self) -> int:
        return len(self.spikes)

    @property
    def num_in_prefill(self) -> int:
        return sum(s.is_in_prefill for s in self.spikes)

    @property
    def spike_fraction(self) -> float:
        """Share of all gaps that are spikes."""
        return self.num_spikes / self.num_gaps if self.num_gaps else 0.0

    @property
    def stalled_s(self) -> float:
        return sum(s.end - s.start for s in self.spikes)

    @property
    def in_prefill_fraction(self) -> float:
        """Share of stalled time in spikes that coincide with a long prompt's prefill."""
        stalled = self.stalled_s
        in_prefill = sum(s.end - s.start for s in self.spikes if s.is_in_prefill)
        return in_prefill / stalled if stalled > 0 else 0.0

    @property
    def prefill_slowdown(self) -> float:
        """Share of streaming time lost to stalls inside long prefills: each such spike's
        excess over the median gap, over the sum of all gaps."""
        median_s = self.median_itl_ms / 1000.0
        excess = sum(s.end - s.start - median_s for s in self.spikes if s.is_in_prefill)
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
    def verdict(self) -> str:
        """One line, e.g. "87% of ITL spikes coincide with long-prompt prefills: phase
        interference (...)"."""
        k = f"{self.config.spike_factor:g}×"
        if not self.spikes:
            return (
                f"No ITL spikes (gaps above {k} the median ITL of {self.median_itl_ms:.1f} ms): "
                "no phase interference."
            )
        if not self.windows:
            return (
                f"{self.num_spikes} ITL spikes but no long prompts "
                f"(>= {self.config.long_prompt_tokens} tokens): not phase interference."
            )
        share = (
            f"{self.in_prefill_fraction:.0%} of stalled time falls in long-prompt prefills, "
            f"which cover {self.window_coverage:.0%} of the run"
        )
        counts = (
            f"{self.num_in_prefill} of {self.num_spikes} spikes above "
            f"{self.spike_threshold_ms:.0f} ms; {self.spike_fraction:.1%} of all gaps; "
            f"stalls in prefills cost {self.prefill_slowdown:.1%} of streaming time"
        )
        outcome = "phase interference" if self.is_interference else "no phase interference"
        return f"{share}: {outcome} ({counts})."

    def to_dict(self) -> dict:
        return {
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


def detect_interference(
    records: list[RequestRecord], config: InterferenceConfig | None = None
) -> InterferenceReport:
    """Line every token gap up with the long prefills in flight."""
    config = config or InterferenceConfig()
    windows = prefill_windows(records, config.long_prompt_tokens)
    gaps = [(r.index, a, b) for r in records for a, b in itertools.pairwise(r.token_times)]
    median_ms = float(np.median([b - a for _, a, b in gaps])) * 1000.0 if gaps else 0.0
    threshold_s = config.spike_factor * median_ms / 1000.0
    spikes = tuple(
        Spike(i, a, b, _overlaps_other(i, a, b, windows)) for i, a, b in gaps if b - a > threshold_s
    )
    times = [t for r in records for t in (r.send_time, *r.token_times) if t is not None]
    span = (min(times), max(times)) if times else (0.0, 0.0)
    streamed_s = sum(b - a for _, a, b in gaps)
    return InterferenceReport(
        config, median_ms, len(gaps), streamed_s, spikes, tuple(windows), span
    )


def _overlaps_other(index: int, start: float, end: float, windows: list[PrefillWindow]) -> bool:
    return any(w.index != index and start < w.end and end > w.start for w in windows)
