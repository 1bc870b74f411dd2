"""The phase-interference detector on timelines with and without injected stalls."""

from __future__ import annotations

import pytest

from pdserve.bench.errors import BenchError
from pdserve.bench.interference import InterferenceConfig, detect_interference
from tests.bench.helpers import record

ITL = 0.02


def _stream(index: int, stall: tuple[float, float] | None, until: float = 2.0):
    """A chat stream ticking every 20 ms from 0.05 s, with one stall window if given."""
    gaps, t = [], 0.05
    while t < until:
        if stall and stall[0] <= t < stall[1]:
            gaps.append(stall[1] - t + ITL)
            t = stall[1] + ITL
        else:
            gaps.append(ITL)
            t += ITL
    return record(index, send=0.0, ttft=0.05, gaps=gaps)


def _long_prompt(index: int = 9, send: float = 0.5, first_token: float = 1.1):
    # Its own decode gaps are slow too; they must not count against its own prefill.
    return record(index, send, first_token - send, [0.2] * 3, prompt_len=4000, kind="long-doc")


def test_stalls_during_a_long_prefill_are_phase_interference():
    records = [_stream(i, stall=(0.55, 1.1)) for i in range(3)] + [_long_prompt()]
    report = detect_interference(records)
    assert report.num_spikes == 6  # 3 streams stalled + the long request's own 3 slow gaps
    stalls = [s for s in report.spikes if s.index != 9]
    assert len(stalls) == 3 and all(s.is_in_prefill for s in stalls)
    assert not any(s.is_in_prefill for s in report.spikes if s.index == 9)
    # Stalled time: three 0.57 s stalls inside the window, the long request's 3 × 0.2 s not.
    assert report.in_prefill_fraction == pytest.approx(1.71 / 2.31, abs=0.01)
    assert report.window_coverage == pytest.approx(0.6 / 2.0, abs=0.02)
    assert report.is_interference
    assert report.verdict.startswith(
        "74% of stalled time falls in long-prompt prefills, which cover 30% of the run: "
        "phase interference"
    )
    assert report.median_itl_ms == pytest.approx(20.0)
    assert report.to_dict()["num_long_prompts"] == 1


def test_a_clean_run_is_not_flagged():
    records = [_stream(i, stall=None) for i in range(3)] + [
        record(9, 0.5, 0.6, [ITL] * 5, prompt_len=4000)
    ]
    report = detect_interference(records)
    assert report.num_spikes == 0
    assert not report.is_interference
    assert report.verdict.startswith("No ITL spikes")


def test_stalls_outside_prefills_are_not_blamed_on_them():
    records = [_stream(i, stall=(1.5, 1.9)) for i in range(3)] + [
        record(9, 0.5, 0.1, [ITL] * 5, prompt_len=4000)
    ]
    report = detect_interference(records)
    assert report.num_spikes == 3
    assert report.in_prefill_fraction == 0.0
    assert not report.is_interference
    assert "0% of stalled time falls in long-prompt prefills" in report.verdict
    assert ": no phase interference" in report.verdict


def test_one_long_freeze_outweighs_many_hiccups():
    """Colocated serving: short prompts' prefills cause many short stalls, a document's one
    long freeze; the freeze is what the verdict is about."""
    hiccups = [_stream(i, stall=(1.5 + 0.01 * i, 1.6 + 0.01 * i)) for i in range(8)]
    frozen = [_stream(i, stall=(0.55, 1.1)) for i in range(8, 14)]
    document = record(20, send=0.5, ttft=0.6, gaps=[ITL] * 3, prompt_len=4000)
    report = detect_interference([*hiccups, *frozen, document])
    assert report.num_in_prefill < report.num_spikes / 2  # by count, most spikes are hiccups
    assert report.in_prefill_fraction > 0.5 and report.is_interference


def test_stalls_that_overlap_long_prefills_only_by_chance_are_not_blamed_on_them():
    """Long prompts queued behind a busy prefill pool are in flight nearly all the run, so
    most stalls overlap one whatever their cause."""
    stalls = ((0.3, 0.4), (0.7, 0.8), (1.1, 1.2), (1.7, 1.8))  # spread over the run
    records = [_stream(i, stall=stall) for i, stall in enumerate(stalls)]
    records.append(record(9, send=0.0, ttft=1.5, gaps=[ITL] * 3, prompt_len=4000))
    report = detect_interference(records)
    assert report.window_coverage == pytest.approx(0.75, abs=0.03)
    assert report.in_prefill_fraction == pytest.approx(0.75, abs=0.03)
    assert not report.is_interference
    assert ": no phase interference" in report.verdict


def test_hiccups_that_cost_nothing_are_not_interference():
    """A busy host's scheduling hiccups (70 ms gaps, 3.5x the ITL, twice in a run) may both
    land inside a prefill; they are not what the verdict is about."""
    hiccup = (0.6, 0.6 + 3 * ITL)
    records = [_stream(0, stall=hiccup), _stream(1, stall=hiccup), _stream(2, stall=None)]
    records.append(record(9, send=0.5, ttft=0.6, gaps=[ITL] * 3, prompt_len=4000))
    report = detect_interference(records)
    assert report.num_in_prefill == report.num_spikes == 2
    assert report.in_prefill_fraction == 1.0 > report.required_fraction
    assert report.prefill_slowdown == pytest.approx(2 * (0.07 - ITL) / report.streamed_s)
    assert not report.is_interference
    assert "cost 1.7% of streaming time" in report.verdict
    assert report.to_dict()["prefill_slowdown"] == report.prefill_slowdown


def test_stalls_without_long_prompts():
    records = [_stream(i, stall=(0.5, 0.9)) for i in range(2)]
    report = detect_interference(records)
    assert report.num_spikes == 2
    assert not report.is_interference
    assert "no long prompts" in report.verdict


def test_a_single_coinciding_spike_is_not_enough():
    records = [_stream(0, stall=(0.55, 1.1)), _long_prompt()]
    config = InterferenceConfig(min_spikes=5)
    assert not detect_interference(records, config).is_interference


def test_long_prompt_threshold_decides_what_counts_as_long():
    records = [_stream(i, stall=(0.55, 1.1)) for i in range(3)] + [_long_prompt()]
    report = detect_interference(records, InterferenceConfig(long_prompt_tokens=5000))
    assert not report.windows and not report.is_interference


def test_config_validation():
    with pytest.raises(BenchError, match="--spike-factor"):
        InterferenceConfig(spike_factor=1.0)
    with pytest.raises(BenchError, match="min_slowdown"):
        InterferenceConfig(min_slowdown=1.0)
    with pytest.raises(BenchError, match="--long-prompt-tokens"):
        InterferenceConfig(long_prompt_tokens=0)
