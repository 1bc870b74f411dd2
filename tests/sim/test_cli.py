import json

from pdserve.cli import main
from pdserve.core.config import DEFAULT_CHUNKED_BUDGET
from pdserve.sim.calibration import StepSample, save_samples
from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS

WORKLOAD = [
    "--workload",
    "random",
    "--num-prompts",
    "12",
    "--input-len",
    "300",
    "--output-len",
    "20",
    "--request-rate",
    "2",
]


def test_simulate_writes_the_benchmarks_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
            "--mode",
            "chunked",
            *WORKLOAD,
            "--goodput",
            "ttft:2000",
            "--save-result",
            str(out),
            "--report",
            str(tmp_path / "report"),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    for key in (
        "completed",
        "request_goodput",
        "mean_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_tpot_ms",
        "mean_e2el_ms",
    ):
        assert key in data
    assert data["completed"] == 12
    layout = f"chunked 1×TP1 budget {DEFAULT_CHUNKED_BUDGET}"
    assert data["pdserve"]["simulation"]["layout"] == layout
    assert len(data["pdserve"]["records"]) == 12
    assert (tmp_path / "report" / "report.md").exists()
    assert "TTFT" in capsys.readouterr().out


def test_simulate_several_modes_prints_the_compare_table(capsys):
    assert main(["simulate", "--mode", "colocated,chunked,disagg", *WORKLOAD]) == 0
    out = capsys.readouterr().out
    assert "disagg 1×TP1:1×TP1" in out and "ITL p99" in out


def test_bad_input_is_one_clear_line(capsys):
    assert main(["simulate", "--hardware", "TPU-v9", *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert "--hardware" in err and "Traceback" not in err
    assert main(["simulate", "--mode", "sideways", *WORKLOAD]) == 2
    assert "--mode" in capsys.readouterr().err
    assert main(["simulate", "--decode-max-num-batched-tokens", "0", *WORKLOAD]) == 2
    assert "--decode-max-num-batched-tokens must be >= 1" in capsys.readouterr().err
    assert main(["simulate", "--burst-gap", "-1", *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert "--burst-gap must be >= 0" in err and "Traceback" not in err


def test_decode_workers_get_their_own_budget(capsys):
    args = ["simulate", "--mode", "disagg", "--local-prefill-threshold", "400", *WORKLOAD]
    assert main([*args, "--decode-max-num-batched-tokens", "128"]) == 0
    assert "disagg 1×TP1:1×TP1 local<400 decode budget 128" in capsys.readouterr().out


def test_calibrate_from_step_file(tmp_path, capsys):
    truth = CostModel(
        MODELS["SmolLM2-135M"],
        get_hardware("cpu-local"),
        efficiency=Efficiency(0.3, 0.05, 0.6, 1.0, 0.004, 0.0002),
    )
    batches = [(SeqWork(n, 0, True),) for n in (64, 256, 1024)]
    batches += [(SeqWork(1, 400, True),) * b for b in (1, 8, 32)]
    steps = tmp_path / "steps.jsonl"
    save_samples([StepSample(b, truth.step_time(b)) for b in batches], steps)
    out = tmp_path / "cal.json"
    assert main(["simulate", "calibrate", "--steps", str(steps), "--output", str(out)]) == 0
    fitted = Efficiency.load(out)
    assert abs(fitted.linear_compute - 0.3) / 0.3 < 0.2
    # The simulator takes the file.
    assert main(["simulate", "--calibration", str(out), *WORKLOAD]) == 0
    assert "fitted on 6 measurements (0 set aside" in capsys.readouterr().out


def test_small_plan_search(tmp_path, capsys):
    code = main(
        [
            "plan",
            "--gpus",
            "2",
            "--slo",
            "ttft:3000,tpot:200",
            *WORKLOAD,
            "--report",
            str(tmp_path),
            "--save-result",
            str(tmp_path / "plan.json"),
            "--quiet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Recommended:" in out and "binding SLO" in out
    assert "GPUs to carry 2 req/s" in out
    assert (tmp_path / "goodput_vs_split.png").exists()
    ranking = json.loads((tmp_path / "plan.json").read_text())["ranking"]
    modes = {row["layout"].split()[0] for row in ranking}
    assert modes == {"colocated", "chunked", "disagg"}
    # The best disagg layout with a local-prefill threshold is tried with smaller decode budgets.
    assert any(
        "local < " in row["layout"] and "decode budget 256" in row["layout"] for row in ranking
    )


def test_workload_from_a_saved_run_replays_it(tmp_path):
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    assert main(["simulate", *WORKLOAD, "--max-concurrency", "3", "--save-result", str(first)]) == 0
    assert main(["simulate", "--workload-from", str(first), "--save-result", str(again)]) == 0
    a, b = json.loads(first.read_text()), json.loads(again.read_text())
    assert a["max_concurrency"] == b["max_concurrency"] == 3
    assert a["input_lens"] == b["input_lens"]
    assert a["p99_ttft_ms"] == b["p99_ttft_ms"]


def test_simulate_prints_each_figure_with_its_calibration_band(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["simulate", "--hardware", "H100-SXM", "--model", "Llama-3.1-8B", *WORKLOAD]
    assert main([*args, "--save-result", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "calibration: h100-sxm-trtllm" in printed
    assert "with the band of calibration h100-sxm-trtllm" in printed
    assert "TTFT p99" in printed and " band " in printed
    band = json.loads(out.read_text())["pdserve"]["simulation"]["band"]
    assert band["calibration"] == "h100-sxm-trtllm" and 0 < band["band"] < 0.5
    # Every step faster by the band, then slower: the figures follow.
    assert band["low"]["median_tpot_ms"] < band["high"]["median_tpot_ms"]
    # Uncalibrated hardware says so and prints no band.
    assert main(["simulate", "--hardware", "L40S", "--model", "Llama-3.1-8B", *WORKLOAD]) == 0
    printed = capsys.readouterr().out
    assert "no band: uncalibrated" in printed and "with the band" not in printed


def test_plan_shows_bands_beside_latencies_and_capacity(capsys):
    args = ["plan", "--hardware", "A100-80GB", "--model", "Llama-3.1-8B", "--gpus", "2"]
    assert main([*args, "--slo", "ttft:3000,tpot:200", *WORKLOAD, "--quiet", "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "calibration: a100-80gb-trtllm" in printed
    assert "in parentheses with every step ±" in printed
    assert "within the calibration band it carries" in printed


def test_simulate_and_bench_read_the_workload_flags_alike():
    """One declaration (`WORKLOAD_FLAGS`), one conversion: the same argv gives both commands
    the same workload options, trace window included."""
    from pdserve.cli import build_parser
    from pdserve.workload.flags import workload_options

    argv = [
        *("--workload", "trace", "--chat-input-len", "10:20", "--prefix-len", "7"),
        *("--trace-window-start", "random", "--trace-duration", "30"),
    ]
    parser = build_parser()
    bench = parser.parse_args(["bench", "--base-url", "http://127.0.0.1:1", *argv])
    simulate = parser.parse_args(["simulate", *argv])
    options = workload_options(bench)
    assert options == workload_options(simulate)
    assert (options.prefix_len, options.chat_input_len.low, options.trace_window.start_s) == (
        7,
        10,
        None,
    )
    assert options.trace_window.duration_s == 30


def test_simulate_takes_the_engine_and_router_flags_as_they_declare_them():
    """Only a default or help that depends on the simulated device differs."""
    from pdserve.engine.args import ENGINE_FLAGS
    from pdserve.router.cli import ROUTING_FLAGS
    from pdserve.server.cli import SERVER_FLAGS
    from pdserve.sim.options import ENGINE_FLAGS_SIMULATED

    declared = {option.name: option for option in (*ENGINE_FLAGS, *ROUTING_FLAGS, *SERVER_FLAGS)}
    for option in ENGINE_FLAGS_SIMULATED:
        own = declared[option.name]
        assert option.dest == own.dest
        for key in ("type", "choices", "action", "metavar"):
            assert option.options.get(key) == own.options.get(key), (option.name, key)


def test_simulate_embeds_the_engines_cache_and_the_routers_config_built_from_their_flags():
    from pdserve.cli import build_parser
    from pdserve.core.config import CacheConfig, Mode
    from pdserve.router.config import KVHandoff, RouterConfig
    from pdserve.sim.options import Deployment, layout_config

    argv = ["simulate", "--mode", "disagg", "--block-size", "32", "--no-prefix-caching"]
    argv += ["--num-kv-blocks", "100", "--decode-policy", "round_robin"]
    argv += ["--kv-handoff", "stream", "--local-prefill-threshold", "64", "--burst-gap", "0"]
    args = build_parser().parse_args(argv)
    config = layout_config(Deployment.from_args(args, with_layout=True), Mode.DISAGG)
    assert config.burst_gap_s == 0
    assert config.cache == CacheConfig(block_size=32, num_blocks=100, enable_prefix_caching=False)
    assert config.router == RouterConfig(
        (),
        (),
        decode_policy="round_robin",
        kv_handoff=KVHandoff.STREAM,
        local_prefill_threshold=64,
        block_size=32,
    )
