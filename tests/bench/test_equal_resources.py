"""`bench compare` on equal cores, end to end on stub servers of known per-engine capacity:
each mode runs its layout for the cores (replicas, or P + D workers), and the verdict names a
winner only where the seeds' intervals separate."""

from __future__ import annotations

import json
import os

import pytest

from pdserve.bench.cli import main
from tests.bench.conftest import REPO_ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores"),
]

STUB = "{python} -m tests.bench.stub_server --host {host} --port {port} --mode {mode}"


def _compare(tmp_path, tokenizer_json, modes: str, schedule: str, *args: str) -> dict:
    out = tmp_path / "cmp"
    code = main(
        [
            "compare",
            *("--modes", modes, "--cores", "2", "--seeds", "2"),
            *("--server-cmd", STUB, "--server-args", schedule, "--health-timeout", "60"),
            *("--tokenizer", str(tokenizer_json), "--no-progress", "--report", str(out)),
            *("--search-rate", "--search-step", "1.5"),
            *args,
        ]
    )
    assert code == 0
    data = json.loads((out / "compare.json").read_text())
    data["report"] = (out / "report.md").read_text()
    return data


def test_two_replicas_beat_one_prefill_one_decode_where_prefill_is_the_bottleneck(
    tmp_path, tokenizer_json, monkeypatch
):
    """Every prompt's prefill takes 100 ms, one at a time per engine: two chunked replicas
    prefill 20 requests/s, 1P+1D's one prefill worker 10."""
    monkeypatch.chdir(REPO_ROOT)
    data = _compare(
        tmp_path,
        tokenizer_json,
        "chunked,disagg",
        "--serial-prefill --ttft-ms 100 --itl-ms 5",
        *("--workload", "random", "--num-prompts", "12", "--input-len", "16"),
        *("--output-len", "4", "--request-rate", "7", "--goodput", "ttft:500"),
        *("--external", "other=http://127.0.0.1:9"),  # nobody there: a failed, unranked row
    )
    rows = {row["name"]: row for row in data["rows"]}
    assert rows["chunked"]["layout"] == "2 chunked replicas"
    assert rows["disagg"]["layout"] == "1 prefill + 1 decode"
    assert rows["chunked"]["num_cores"] == rows["disagg"]["num_cores"] == 2
    assert rows["chunked"]["num_engines"] == rows["disagg"]["num_engines"] == 2
    assert rows["other"]["num_cores"] is None and rows["other"]["error"]
    assert data["config"]["layouts"]["chunked"]["layout"] == "2 chunked replicas"
    # The deciding rates ran at a second seed.
    assert {p["seed"] for p in data["search"]["chunked"]["points"]} == {0, 1}
    assert rows["chunked"]["max_rate"] >= rows["disagg"]["min_missed_rate"]
    assert data["recommendation"]["name"] == "chunked", data["recommendation"]
    assert "clear of the others" in data["recommendation"]["reason"]
    assert "| chunked | 2 chunked replicas | 2 |" in data["report"]


def test_one_prefill_one_decode_wins_where_long_prefills_stall_the_replicas_streams(
    tmp_path, tokenizer_json, monkeypatch
):
    """Colocated replicas freeze their streams for each 400 ms long prefill; disagg's decode
    worker never prefills; the SLO allows no gap over 150 ms."""
    monkeypatch.chdir(REPO_ROOT)
    data = _compare(
        tmp_path,
        tokenizer_json,
        "colocated,disagg",
        "--ttft-ms 20 --itl-ms 10 --long-prompt-words 250 --long-ttft-ms 400",
        *("--workload", "mixed", "--num-prompts", "12", "--request-rate", "8"),
        *("--long-fraction", "0.3", "--chat-input-len", "16:32", "--chat-output-len", "40:60"),
        *("--long-input-len", "300:350", "--long-output-len", "2:3"),
        *("--long-prompt-tokens", "250", "--goodput", "max_itl:150", "--search-max-runs", "2"),
        *("--external", "ext=http://127.0.0.1:9@2"),
    )
    rows = {row["name"]: row for row in data["rows"]}
    assert rows["colocated"]["layout"] == "2 colocated replicas"
    assert rows["colocated"]["is_interference"]
    assert rows["ext"]["num_cores"] == 2 and rows["ext"]["layout"] == "external on 2 cores"
    assert data["recommendation"]["name"] == "disagg", data["recommendation"]
