"""The interference and overload detector on timelines with known stalls and paces."""

from __future__ import annotations

import pytest

from pdserve.workload.errors import BenchError
from pdserve.workload.interference import (
    RUN_REFERENCE,
    WARMUP_REFERENCE,
    InterferenceConfig,
    detect_interference,
)
from tests.bench.helpers import record

ITL = 0.02


def _stream(
    index: int,
    stall: tuple[float, float] | None,
    until: float = 2.0,
    pace: float = ITL,
    send: float = 0.0,
):
    """A chat stream ticking every `pace` s from `send` + 0.05 s, with one stall if given."""
    gaps, t = [], send + 0.05
    while t < until:
        if stall and stall[0] <= t < stall[1]:
            gaps.append(stall[1] - t + pace)
            t = stall[1] + pace
        else:
            gaps.append(pace)
            t += pace
    return record(index, send=send, ttft=0.05, gaps=gaps)


def _long_prompt(index: int = 9, send: float = 0.5, first_token: float = 1.1, pace: float = 0.2):
    return record(index, send, first_token - send, [pace] * 3, prompt_len=4000, kind="long-doc")


def _warmup(pace: float = ITL):
    """A request sent alone before the run: the server's unloaded pace."""
    return record(-1, send=0.0, ttft=0.03, gaps=[pace] * 15, prompt_len=32, kind="warmup")


# --- the four cases: overload, interference, both, neither --------------------------------

SLOW = 10 * ITL  # an overloaded server's step: ten times its unloaded one
DOC = (2.0, 3.5)  # a document's prefill window in the overloaded runs


def _overloaded_run(freeze: bool):
    """Six streams at 10x the unloaded step from start to end, a document prefilled in the
    middle; with `freeze`, every stream stops for the whole prefill."""
    streams = [_stream(i, DOC if freeze else None, until=6.0, pace=SLOW) for i in range(6)]
    document = _long_prompt(send=DOC[0], first_token=DOC[1], pace=SLOW)
    return [*streams, document]


def test_a_uniformly_slow_run_without_stalls_is_overload_not_interference():
    report = detect_interference(_overloaded_run(freeze=False), unloaded=[_warmup()])
    assert report.num_spikes == 0 and not report.is_interference
    assert report.overload.pace_ms == pytest.approx(SLOW * 1000)
    assert report.overload.slowdown == pytest.approx(10.0)
    assert report.overload.reference_source == WARMUP_REFERENCE
    assert report.is_overload and report.finding == "overload"
    assert report.verdict.startswith("Overload: no stalls")
    assert "10.0× the unloaded 20 ms" in report.verdict


def test_b_an_overloaded_run_with_a_freeze_inside_a_prefill_is_both():
    report = detect_interference(_overloaded_run(freeze=True), unloaded=[_warmup()])
    stalls = [s for s in report.spikes if s.index != 9]
    assert len(stalls) == 6 and all(s.is_in_prefill for s in stalls)
    # Each freeze is judged against its stream's own (slow) pace, not the unloaded one.
    assert all(s.baseline == pytest.approx(SLOW) for s in stalls)
    assert report.is_interference and report.is_overload
    assert report.finding == "both" and report.verdict.startswith("Both: ")
    assert report.prefill_slowdown > 0.2


def test_c_a_clean_run_with_a_prefill_stall_is_interference():
    records = [_stream(i, stall=(0.55, 1.1)) for i in range(3)] + [_long_prompt()]
    report = detect_interference(records, unloaded=[_warmup()])
    # The long request's own slow decode is its own pace, not a stall.
    assert report.num_spikes == 3
    assert all(s.is_in_prefill and s.index != 9 for s in report.spikes)
    assert report.in_prefill_fraction == 1.0
    assert report.window_coverage == pytest.approx(0.6 / 2.0, abs=0.02)
    assert report.is_interference and not report.is_overload
    assert report.finding == "interference"
    assert report.verdict.startswith(
        "Interference: 100% of stalled time falls in long-prompt prefills, which cover 30% of "
        "the run, and costs the streams"
    )
    assert report.median_itl_ms == pytest.approx(20.0)
    assert report.to_dict()["num_long_prompts"] == 1
    assert report.to_dict()["finding"] == "interference"


def test_d_a_clean_run_is_neither():
    records = [_stream(i, stall=None) for i in range(3)] + [
        record(9, 0.5, 0.6, [ITL] * 5, prompt_len=4000)
    ]
    report = detect_interference(records, unloaded=[_warmup()])
    assert report.num_spikes == 0
    assert not report.is_interference and not report.is_overload
    assert report.finding == "neither"
    assert report.overload.slowdown == pytest.approx(1.0)
    assert report.verdict.startswith("Neither: no stalls")


def test_the_issue_case_freeze_then_slow_decode_is_both():
    """Colocated on a slow CPU: every stream frozen while documents prefill, then a long
    stretch of slow gaps at a large batch. The slow stretch must not hide the freeze."""
    freeze = (2.0, 30.0)
    streams = [
        record(i, send=0.1 * i, ttft=0.2, gaps=[0.165] * 10 + [freeze[1] - 2.0] + [1.5] * 50)
        for i in range(16)
    ]
    documents = [
        record(20 + j, send=freeze[0], ttft=freeze[1] - freeze[0], gaps=[1.5] * 5, prompt_len=3000)
        for j in range(2)
    ]
    report = detect_interference([*streams, *documents], unloaded=[_warmup(0.06)])
    assert report.is_interference and report.in_prefill_fraction > 0.95
    assert report.is_overload and report.overload.slowdown == pytest.approx(25.0)
    assert report.finding == "both"


def test_chats_that_cannot_start_while_a_document_prefills_are_stalled():
    """Colocated serving takes a prompt whole: chats arriving during a document's prefill
    get no first token until it ends. Their streams never ran, so only their wait shows it."""
    early = [record(i, send=0.1 * i, ttft=0.05, gaps=[ITL] * 5) for i in range(4)]
    document = record(9, send=1.0, ttft=3.0, gaps=[ITL] * 3, prompt_len=4000)
    blocked = [
        record(10 + i, send=1.2 + 0.5 * i, ttft=2.8 - 0.5 * i, gaps=[ITL] * 5) for i in range(4)
    ]
    late = [record(20 + i, send=5.0 + 0.1 * i, ttft=0.05, gaps=[ITL] * 5) for i in range(4)]
    report = detect_interference([*early, document, *blocked, *late])
    starts = [s for s in report.spikes if s.is_first_token]
    assert sorted(s.index for s in starts) == [10, 11, 12, 13]
    assert all(s.is_in_prefill and s.baseline == pytest.approx(0.05) for s in starts)
    assert report.is_interference and report.finding == "interference"
    assert "4 of them before a first token" in report.verdict


# --- overload's reference -------------------------------------------------------------------


def test_without_a_warm_up_the_run_s_fastest_pace_is_the_reference():
    fast_then_slow = [
        record(i, send=0.0, ttft=0.05, gaps=[ITL] * 20 + [5 * ITL] * 100) for i in range(3)
    ]
    report = detect_interference(fast_then_slow)
    assert report.overload.reference_source == RUN_REFERENCE
    assert report.overload.reference_ms == pytest.approx(20.0)
    assert report.is_overload and report.num_spikes == 0


def test_the_last_warm_up_with_enough_tokens_is_the_reference():
    cold = record(-1, send=0.0, ttft=2.0, gaps=[0.5] * 15, prompt_len=32)
    short = record(-1, send=0.0, ttft=0.03, gaps=[0.001], prompt_len=32)
    records = [_stream(i, stall=None, pace=0.05) for i in range(2)]
    report = detect_interference(records, unloaded=[cold, _warmup(0.025), short])
    assert report.overload.reference_ms == pytest.approx(25.0)
    assert report.overload.slowdown == pytest.approx(2.0) and not report.is_overload


def test_no_gaps_no_reference():
    report = detect_interference([record(0, send=0.0, ttft=0.1, gaps=[])])
    assert report.overload.reference_ms is None and not report.is_overload
    assert "no unloaded pace" in report.verdict


# --- interference's weighing (kept from the first detector) ---------------------------------


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
    assert "costs the streams 1.6% of their time" in report.verdict
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
    with pytest.raises(BenchError, match="--overload-factor"):
        InterferenceConfig(overload_factor=1.0)
