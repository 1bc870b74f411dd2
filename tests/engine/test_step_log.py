"""`--step-log`: every engine step's batch and wall time, in the format calibration reads."""

import json

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.sim.calibration import load_samples


def test_step_log_records_every_step_as_calibration_samples(make_llm, tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = make_llm(mode="chunked", max_num_batched_tokens=16, step_log=str(path))
    prompts = [list(range(100, 140)), list(range(200, 205))]  # 40 and 5 tokens
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    llm.engine.shutdown()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # The first step is the first 16-token chunk; then 45 prompt tokens + 2 × 2 decodes.
    first = rows[0]["batch"]
    assert first == [[16, 0, False]]
    assert sum(new for row in rows for new, _, _ in row["batch"]) == 45 + 2 * 2
    assert all(row["step_s"] > 0 for row in rows)
    # Context is what the sequence had before the step: prompt 1 chunks at 0, 16, 32.
    chunks = [(new, context) for row in rows for new, context, _ in row["batch"] if new > 1]
    assert chunks[:3] == [(16, 0), (16, 16), (8, 32)]
    assert len(load_samples(path)) == len(rows)


def test_one_step_timer_feeds_records_stats_and_prefill_time(make_llm):
    llm = make_llm(mode="chunked", max_num_batched_tokens=16)
    engine = llm.engine
    records = []
    engine.step_observers.append(records.append)
    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        assert engine.get_stats().last_step_time == records[-1].step_s
    assert engine.get_stats().num_steps == len(records) == 4  # 3 chunks, then 1 decode
    # The prompt's three chunk steps are its prefill time.
    prefill = sum(r.step_s for r in records[:3])
    assert outputs[-1].metrics.prefill_time == pytest.approx(prefill)
