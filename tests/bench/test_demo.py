"""The demo fitted to the machine: sizing from measured speeds, and end to end on stubs
standing in for a fast and a slow machine."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.cli import main
from pdserve.bench.demo import (
    DOC_LEN_RANGE,
    LOAD,
    PROBE_BATCH,
    STALL_SCALE,
    MachineProfile,
    size_demo,
)
from pdserve.bench.layout import disagg_split
from pdserve.workload.errors import BenchError
from tests.bench.conftest import REPO_ROOT


def _profile(speed: float, start_s: float = 10.0) -> MachineProfile:
    """A machine whose every duration is this machine's (measured) / speed."""
    return MachineProfile(
        mode="colocated",
        start_s=start_s,
        prefill_lens=(512, 1536),
        prefill_s=(0.28 / speed, 0.75 / speed),
        decode_step_s=0.027 / speed,
        batch_step_s=0.064 / speed,
    )


def test_prefill_time_goes_through_the_measured_points_and_inverts():
    p = MachineProfile("colocated", 1.0, (512, 1536), (0.3, 1.2), 0.02, 0.05)
    assert p.prefill_time(512) == pytest.approx(0.3)
    assert p.prefill_time(1536) == pytest.approx(1.2)
    assert p.prefill_time(3072) > 2 * 1.2  # attention's square
    assert p.tokens_in(p.prefill_time(4000)) == pytest.approx(4000, abs=2)
    linear = MachineProfile("colocated", 1.0, (512, 1536), (0.3, 0.8), 0.02, 0.05)
    assert linear.prefill_time(3072) == pytest.approx(0.8 * 2)  # no negative square


def test_a_slower_machine_gets_a_lighter_load_in_its_own_units():
    fast, slow = size_demo(_profile(1.0), 870, 3), size_demo(_profile(0.25), 870, 3)
    # Runs last as long on both; the slow machine gets less work per request, and less load.
    assert slow.run_s == pytest.approx(fast.run_s)
    assert slow.request_rate < fast.request_rate
    assert slow.workload.long_input_len.high < fast.workload.long_input_len.high
    assert slow.workload.chat_output_len.high < fast.workload.chat_output_len.high
    for plan in (fast, slow):
        p, w = plan.profile, plan.workload
        assert DOC_LEN_RANGE[0] <= w.long_input_len.low <= w.long_input_len.high
        assert plan.slos["max_itl"] == pytest.approx(STALL_SCALE * p.batch_step_s * 1000, abs=0.5)
        assert plan.slos["ttft"] > 1000 * p.prefill_time(w.long_input_len.high)
        assert plan.long_prompt_tokens <= w.long_input_len.low
        # The offered load is LOAD x the one-engine capacity the measured costs imply.
        assert plan.request_rate <= LOAD * plan.capacity
        assert w.num_long >= 2
        # Failing every document fails the attainment target.
        assert w.num_long / w.num_prompts > 1 - plan.search.attainment
        assert plan.search.budget_s > 0
        assert "--max-num-batched-tokens" in plan.mode_args()["chunked"]
    assert any(f"batch {PROBE_BATCH}" in line for line in slow.explain())
    with pytest.raises(BenchError, match="--time-budget"):
        size_demo(_profile(1.0, start_s=400.0), 870, 3)


def test_every_mode_is_sized_for_the_same_cores():
    one, four = size_demo(_profile(1.0), 870, 3, 1), size_demo(_profile(1.0), 870, 3, 4)
    # One engine per core (the document share shifts a little with the request count).
    assert four.capacity == pytest.approx(4 * one.capacity, rel=0.1)
    assert four.request_rate > one.request_rate
    assert 0 < four.prefill_share < 1
    assert four.disagg_split == disagg_split(4, four.prefill_share)
    assert size_demo(_profile(1.0), 870, 3, 2).disagg_split == (1, 1)
    assert any("every mode on 4 cores" in line for line in four.explain())
    assert four.to_dict()["disagg_split"] == list(four.disagg_split)
    assert four.num_seeds > 1


def test_token_budgets_follow_the_cost_of_a_document_s_last_slice():
    """Where attention over a long prefix is dear, a slice of the same size stalls longer:
    the chunked budget shrinks to keep the stall within a third of the longest-gap SLO."""
    flat = MachineProfile("colocated", 1.0, (512, 1536), (0.25, 0.75), 0.03, 0.06)
    steep = MachineProfile("colocated", 1.0, (512, 1536), (0.25, 1.5), 0.03, 0.06)
    budgets = {}
    for name, profile in (("flat", flat), ("steep", steep)):
        plan = size_demo(profile, 870, 3)
        last = profile.slice_time(plan.workload.long_input_len.high, plan.chunk_budget)
        assert last <= plan.slos["max_itl"] / 3000 or plan.chunk_budget == 64
        budgets[name] = plan.chunk_budget
    assert budgets["steep"] < budgets["flat"]


STUB = "{python} -m tests.bench.stub_server --host {host} --port {port} --mode {mode}"
# A stub engine: prefills one at a time at 8,000 words/s, decode steps of 5 ms growing 5% per
# stream, prompts of 400+ words long (the colocated preset stalls streams behind them).
STUB_LAW = "--serial-prefill --prefill-wps 8000 --ttft-ms 5 --itl-ms 5 --batch-cost 0.05"


def _demo(tmp_path, tokenizer_json, speed: float) -> dict:
    out = tmp_path / f"demo-{speed:g}"
    code = main(
        [
            "demo",
            "--modes",
            "colocated,disagg",
            "--time-budget",
            "50",
            "--server-cmd",
            STUB,
            "--server-args",
            f"{STUB_LAW} --long-prompt-words 400 --speed {speed}",
            "--health-timeout",
            "60",
            "--tokenizer",
            str(tokenizer_json),
            "--no-progress",
            "--report",
            str(out),
        ]
    )
    assert code == 0
    assert (out / "report.md").read_text().startswith("# pdserve bench compare\n\n## Sized for")
    compare = json.loads((out / "compare.json").read_text())
    return {"sizing": json.loads((out / "sizing.json").read_text()), "compare": compare}


@pytest.mark.slow
def test_the_demo_fits_a_fast_and_a_slow_machine(tmp_path, tokenizer_json, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    fast = _demo(tmp_path, tokenizer_json, speed=1.0)
    slow = _demo(tmp_path, tokenizer_json, speed=0.3)
    printed = capsys.readouterr().out
    assert printed.count("measured (colocated server") == 2
    speeds = [d["sizing"]["profile"]["batch_step_s"] for d in (fast, slow)]
    assert speeds[1] > 2 * speeds[0]  # the probe saw the slower machine
    assert slow["sizing"]["request_rate"] < fast["sizing"]["request_rate"]
    for demo in (fast, slow):
        compare = demo["compare"]
        assert compare["config"]["goodput_slos_ms"] == demo["sizing"]["slos_ms"]
        maxima = {name: s["max_rate"] for name, s in compare["search"].items()}
        assert any(maxima.values()), maxima  # some mode meets the SLOs at a searched rate
        assert compare["recommendation"]["name"] in maxima
