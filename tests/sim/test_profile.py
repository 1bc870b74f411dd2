"""The profile workload, measured from outside, and calibrations fitted to it."""

from __future__ import annotations

import json
import statistics

import pytest

from pdserve.bench.benchmark import run_benchmark
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.cli import main
from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import Calibration
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.profile import ProfileWorkload, profile_points
from pdserve.workload.records import RequestRecord
from pdserve.workload.results import save_results
from pdserve.workload.run import BenchSpec
from tests.bench.conftest import REPO_ROOT
from tests.sim.law_server import LAW, MAX_MODEL_LEN, TRUTH

BUDGET = 512


class WordTokenizer:
    """One token per whitespace-separated word: prompt lengths the law server can count."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def test_points_cover_both_sweeps_within_the_context():
    workload = ProfileWorkload(
        prompt_lens=(128, 1024, 8192), num_streams=(1, 4, 64), contexts=(128, 2048)
    )
    points = workload.points(4096)
    assert ("ttft", 1, 1024, 1) in points and all(p[2] < 4096 for p in points)
    itl = [p for p in points if p[0] == "itl"]
    assert {p[1] for p in itl} == {1, 4, 64} and {p[2] for p in itl} == {128, 2048}
    # 64 streams of 2,048 tokens exceed the default 32,768-token cap.
    assert all(p[1] * (p[2] + p[3]) <= workload.max_batch_tokens for p in itl)
    # Streams decode long enough to outlast the others' prefill at a 256-token budget.
    assert all(p[3] > 32 + p[1] * p[2] // 256 for p in itl)


def test_steady_window_excludes_prefill_and_tail():
    def record(index, first, gaps, prompt_len=100):
        times = [first]
        for gap in gaps:
            times.append(times[-1] + gap)
        return RequestRecord(
            index, "profile:itl:2:100:0", prompt_len, len(times), 0.0, 0.0, times[-1], times
        )

    # Stream 0 starts at 1.0 and decodes alone until stream 1's first token at 1.5.
    records = [record(0, 1.0, [0.1] * 5 + [0.2] * 5), record(1, 1.5, [0.2] * 4)]
    [point] = profile_points(records)
    assert point["kind"] == "itl" and point["num_streams"] == 2
    assert point["seconds"] == pytest.approx(0.2)
    assert all(o == pytest.approx(0.2) for o in point["observations"])


def test_calibrating_from_a_run_that_is_no_profile_is_one_clear_line(tmp_path, capsys):
    run = {"pdserve": {"records": [RequestRecord(0, "chat", 10, 4, 0.0).to_dict()]}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    argv = ["simulate", "calibrate", "--bench", str(path), "--output", str(tmp_path / "c.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not a profile run" in err and "Traceback" not in err
    path.write_text("{}")
    assert main(argv) == 2
    assert "is not a pdserve bench result" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_of_a_server_with_a_known_law_recovers_the_law(tmp_path):
    """The law server's steps take exactly what a cost model says; profiling it from outside
    and calibrating must give back that model's step times within 5%."""
    config = LaunchConfig(
        command=("{python}", "-m", "tests.sim.law_server", "--host", "{host}", "--port", "{port}"),
        extra_args=("--max-num-batched-tokens", str(BUDGET)),
        health_timeout_s=60.0,
        stop_grace_s=5.0,
        log_dir=tmp_path,
        cwd=REPO_ROOT,
    )
    # Nine repeats a point: the prompts near the knee (where prefill turns compute-bound)
    # differ by a few ms, as much as the stub's HTTP varies on a busy machine; five put
    # prefill(300) 8-11% off with other work on the core, nine within 3%.
    workload = ProfileWorkload(
        num_prompts=9,
        prompt_lens=(16, 64, 128, 181, 256, 362, 512, 1024, 2048, 4000),
        num_streams=(1, 2, 4, 8),
        contexts=(128, 1024),
        output_len=16,
    )
    with launch_server(config, "law") as server:
        spec = BenchSpec(EndpointConfig(server.base_url), workload, show_progress=False)
        results = run_benchmark(spec, WordTokenizer())
    profile = save_results(results, tmp_path / "profile.json")
    out = tmp_path / "law.json"
    argv = ["simulate", "calibrate", "--bench", str(profile), "--model", "Llama-3.1-8B"]
    argv += ["--hardware", "A100-80GB", "--max-num-batched-tokens", str(BUDGET)]
    assert main([*argv, "--output", str(out)]) == 0
    calibration = Calibration.load(out)
    fitted = CostModel(LAW.model, LAW.hardware, efficiency=calibration.efficiency)
    # What the profile did not measure, within what it covered: prompts' prefill (their
    # chunks' steps) and decode steps.
    for prompt_len in (100, 300, 700, 1500, 3000):
        law = LAW.prefill_time(prompt_len, BUDGET)
        assert fitted.prefill_time(prompt_len, BUDGET) == pytest.approx(law, rel=0.05)
    for batch in ([SeqWork(1, c, True)] * b for b in (1, 3, 6) for c in (200, 900)):
        assert fitted.step_time(batch) == pytest.approx(LAW.step_time(batch), rel=0.05)
    # What a client sees before the first step: the law's front end plus the stub's HTTP,
    # whose time is this machine's (~5 ms here, several times that on a slow one): what
    # the client measured beyond the law's time to first token, the median over the prompts.
    http_s = statistics.median(
        p["seconds"] - LAW.prefill_time(p["prompt_len"], BUDGET) - TRUTH.request_overhead_s
        for p in profile_points(results[0].records)
        if p["kind"] == "ttft"
    )
    assert http_s >= 0  # the law is a floor: a client sees nothing sooner
    # Within 5% of a one-step time to first token, as the prefill: the overhead is the
    # request's, not taken by the steps' overheads (nor they by it).
    first_token_s = TRUTH.request_overhead_s + http_s + LAW.prefill_time(16, BUDGET)
    assert calibration.efficiency.request_overhead_s == pytest.approx(
        TRUTH.request_overhead_s + http_s, abs=0.05 * first_token_s
    )
    saved = json.loads(out.read_text())
    assert saved["max_num_batched_tokens"] == BUDGET and saved["stack"].startswith("measured")
    # Each point fitted within 5% beyond its own repeats' spread (small prompts' TTFT is
    # mostly the stub's HTTP time, which varies by a few ms).
    assert all(abs(p["residual"]) < 0.05 + p["spread"] for p in saved["points"])
    assert MAX_MODEL_LEN > 2048


# The held-back workload's figures the simulation must reach (CI noise: 25%).
# Each figure's tolerance: 25% (CI noise), except the ITL tail: its gaps are the steps that
# mix decodes with a prompt's chunk, which run per op where a decode-only step is one fused
# call; the profile times decode-only steps, so the model is a quarter fast there (-24% to
# -29% measured on 2 vCPUs).
HELD_BACK_FIGURES = {"median_ttft_ms": 0.25, "p90_ttft_ms": 0.25, "median_itl_ms": 0.25}
HELD_BACK_FIGURES["p90_itl_ms"] = 0.35
HELD_BACK_REPEATS = 3
REAL_SERVER_BUDGET = 128
SMALL_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)


@pytest.mark.slow
def test_real_server_calibrated_from_outside_predicts_a_held_back_workload(tmp_path, capsys):
    """`pdserve serve` on a tiny model: profile it, calibrate, then simulate another
    workload measured on the same server."""
    server_conftest = pytest.importorskip("tests.server.conftest")
    from pdserve.workload.tokenizer import load_tokenizer

    # Wide enough that a step (~10 ms) outlasts the timer noise of a busy 2-core machine.
    model = server_conftest.write_tiny_model(tmp_path / "small", **SMALL_SHAPE)
    engine_args = ["--max-model-len", "1024", "--max-num-batched-tokens"]
    server = server_conftest.start_server(
        tmp_path, "--model", str(model), *engine_args, str(REAL_SERVER_BUDGET)
    )
    tokenizer = load_tokenizer(str(model))
    try:
        profile = ProfileWorkload(
            prompt_lens=(16, 64, 128, 256, 512, 900),
            num_streams=(1, 2, 4, 8),
            contexts=(64, 256),
            output_len=16,
        )
        spec = BenchSpec(EndpointConfig(server.url), profile, show_progress=False)
        save_results(run_benchmark(spec, tokenizer), tmp_path / "profile.json")
        bench = ["bench", "--base-url", server.url, "--tokenizer", str(model), "--no-progress"]
        # Below saturation: a few requests overlap, none queues for long.
        workload = ["--workload", "random", "--num-prompts", "20", "--input-len", "200"]
        workload += ["--output-len", "32", "--range-ratio", "0.5", "--request-rate", "2"]
        # The same workload measured HELD_BACK_REPEATS times: a p90 over 20 requests moves
        # by tens of percent between runs on a busy machine, and the simulation is judged
        # against the run nearest to it (the machine's own spread is no prediction error).
        # One warm-up run first, not judged: the first visit of these prompt lengths pays
        # one-off costs the simulator does not model (a Zen 3 CI run measured its first
        # run's median TTFT 50% above the two runs after it, its p90 ITL 3x).
        runs = [tmp_path / f"held_back_{i}.json" for i in range(HELD_BACK_REPEATS + 1)]
        for run in runs:
            assert main([*bench, *workload, "--save-result", str(run)]) == 0
        runs = runs[1:]
    finally:
        server.stop()
    cal = tmp_path / "cal.json"
    deployment = ["--model", str(model), "--hardware", "cpu-local"]
    budget = ["--max-num-batched-tokens", str(REAL_SERVER_BUDGET)]
    argv = ["simulate", "calibrate", "--bench", str(tmp_path / "profile.json"), *deployment]
    assert main([*argv, *budget, "--output", str(cal)]) == 0
    fit_report = capsys.readouterr().out
    predicted = tmp_path / "predicted.json"
    argv = ["simulate", "--mode", "chunked", *deployment, *budget, "--calibration", str(cal)]
    argv += ["--workload-from", str(runs[0]), "--num-kv-blocks", "256"]
    assert main([*argv, "--max-model-len", "1024", "--save-result", str(predicted)]) == 0
    capsys.readouterr()
    simulated = json.loads(predicted.read_text())
    measured_runs = [json.loads(run.read_text()) for run in runs]
    errors = {
        k: min((simulated[k] / m[k] - 1 for m in measured_runs), key=abs) for k in HELD_BACK_FIGURES
    }
    with capsys.disabled():
        print(f"\n{fit_report}")
        print("held-back workload, measured (each run) vs simulated from the calibration:")
        for key, error in errors.items():
            each = " ".join(f"{m[key]:.1f}" for m in measured_runs)
            print(f"  {key:<15} {each} ms  {simulated[key]:8.1f} ms  {error:+.0%}")
    assert all(abs(e) <= HELD_BACK_FIGURES[k] for k, e in errors.items()), errors
