"""`--step-log`: every engine step's batch and wall time, in the format calibration reads."""

import json

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
