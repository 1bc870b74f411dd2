"""The command line: `pdserve bench`, its sweep, trace replay, conversion and errors."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys

import numpy as np
import pytest

from pdserve.bench import cli
from pdserve.bench.client import make_http_client
from pdserve.bench.runner import heap_frozen, run_requests
from pdserve.workload import load_trace
from pdserve.workload.base import BenchRequest
from pdserve.workload.endpoint import EndpointConfig
from tests.bench.conftest import REPO_ROOT, running_stub
from tests.bench.test_trace_file import AZURE_ROWS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stub_url(tmp_path_factory):
    with running_stub(tmp_path_factory.mktemp("stub"), "--itl-ms", "5", "--ttft-ms", "10") as url:
        yield url


def test_add_parser_wires_into_a_top_level_cli():
    top = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(top.add_subparsers(dest="command"))
    args = top.parse_args(["bench", "--base-url", "http://x:1", "--request-rate", "2"])
    assert (args.command, args.bench_command, args.base_url, args.run) == (
        "bench",
        None,
        "http://x:1",
        cli.run,
    )
    args = top.parse_args(["bench", "compare", "--modes", "chunked", "--seed", "4"])
    assert (args.bench_command, args.modes, args.seed, args.report) == (
        "compare",
        "chunked",
        4,
        "bench-compare",
    )


def test_rate_sweep_writes_results_and_report(stub_url, tokenizer_json, tmp_path, capsys):
    code = cli.main(
        [
            "--base-url",
            stub_url,
            "--tokenizer",
            str(tokenizer_json),
            "--workload",
            "random",
            "--num-prompts",
            "6",
            "--input-len",
            "40",
            "--output-len",
            "4",
            "--request-rate",
            "10,40",
            "--goodput",
            "ttft:500",
            "--no-progress",
            "--save-result",
            str(tmp_path / "r.json"),
            "--report",
            str(tmp_path / "rep"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("Goodput (req/s):") == 2 and out.count("phase interference") == 2
    runs = json.loads((tmp_path / "r.json").read_text())["sweep"]
    assert [r["request_rate"] for r in runs] == [10.0, 40.0]
    assert all(r["completed"] == 6 for r in runs)
    assert (tmp_path / "rep" / "goodput_vs_rate.png").is_file()
    assert "## Rate sweep" in (tmp_path / "rep" / "report.md").read_text()


def test_convert_then_replay_a_trace(stub_url, tokenizer_json, tmp_path, capsys):
    csv = tmp_path / "azure.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{t},{c},{g}" for t, c, g in AZURE_ROWS]
    csv.write_bytes(("\r\n".join(rows) + "\r\n").encode())
    jsonl = tmp_path / "t.jsonl"
    assert (
        cli.main(
            [
                "convert-trace",
                "--input",
                str(csv),
                "--output",
                str(jsonl),
                "--num-prompts",
                "4",
                "--trace-time-scale",
                "0.1",
                "--trace-max-input-len",
                "500",
                "--trace-max-output-len",
                "6",
            ]
        )
        == 0
    )
    assert "wrote 4 requests" in capsys.readouterr().out
    entries = load_trace(jsonl)
    assert [e.prompt_len for e in entries] == [374, 396, 500, 91]
    assert entries[-1].timestamp == pytest.approx(0.4710427)

    code = cli.main(
        [
            "--base-url",
            stub_url,
            "--tokenizer",
            str(tokenizer_json),
            "--workload",
            "trace",
            "--trace",
            str(jsonl),
            "--no-progress",
            "--save-result",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["request_rate"] == "trace"
    assert result["input_lens"] == [374, 396, 500, 91]
    assert result["total_output_tokens"] == 6 + 6 + 6 + 6
    arrivals = [r["arrival_time"] for r in result["pdserve"]["records"]]
    assert arrivals == pytest.approx([e.timestamp for e in entries])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "speed:3"], "--goodput: expected METRIC:MS"),
        (["--request-rate", "fast"], "--request-rate: 'fast' is not a number"),
        (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
        (["--workload", "trace", "--trace", "/nonexistent.jsonl"], "no such file"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "no such file"),
        (["--chat-input-len", "5:1"], "--chat-input-len"),
        (["--trace-window-start", "soon", "--workload", "trace"], "--trace-window-start"),
        (["compare", "--modes", "", "--external", "vllm"], "--external: expected NAME=URL"),
        (["compare", "--request-rate", "1,2"], "one --request-rate, not a sweep"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, tokenizer_json, capsys):
    code = cli.main(
        [*argv, "--tokenizer", str(tokenizer_json)] if "--tokenizer" not in argv else argv
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pdserve bench: error: ") and message in err
    assert "Traceback" not in err


def test_module_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.bench", "compare", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--external NAME=URL" in done.stdout


def test_a_timed_run_keeps_the_clients_heap_from_the_collector_then_hands_it_back(stub_url):
    """A full collection pauses the client (and the records blame the server): the objects
    alive before a run are frozen while it runs and thawed after; a freeze that was there
    before (a server's start-up heap) is left alone."""
    held = [[i] for i in range(50_000)]  # container objects the collector tracks
    endpoint = EndpointConfig(base_url=stub_url, model="stub-model")
    requests = [BenchRequest("one two three", 3, 4) for _ in range(3)]
    frozen_during: list[int] = []

    def watch(records, now) -> bool:
        frozen_during.append(gc.get_freeze_count())
        return False

    async def run() -> list:
        async with make_http_client(endpoint) as http:
            arrivals = np.array([0.0, 0.15, 0.3])
            records, _ = await run_requests(
                http,
                endpoint,
                "stub-model",
                requests,
                arrivals,
                show_progress=False,
                stop_when=watch,
            )
            return records

    assert gc.get_freeze_count() == 0
    assert all(r.success for r in asyncio.run(run()))
    assert frozen_during and min(frozen_during) >= len(held)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a process that froze its own heap for good
    try:
        before = gc.get_freeze_count()
        with heap_frozen():
            assert gc.get_freeze_count() == before
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
