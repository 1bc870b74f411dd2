"""`bench compare` against real `pdserve serve` processes on a tiny random-weight model."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.cli import main
from tests.bench.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

SERVER_ARGS = "--device cpu --dtype float32 --num-kv-blocks 256 --max-model-len 1024"


def _serve_modes() -> list[str]:
    """The modes `pdserve serve --mode` accepts today (disagg arrives with its issue)."""
    from pdserve.cli import build_parser

    parser = build_parser()
    modes = []
    for mode in ("colocated", "chunked", "disagg"):
        try:
            parser.parse_args(["serve", "--mode", mode])
            modes.append(mode)
        except SystemExit:
            pass
    return modes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    server_conftest = pytest.importorskip("tests.server.conftest")
    return server_conftest.write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_compare_on_real_servers_writes_all_artefacts(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    modes = _serve_modes()
    out = tmp_path / "cmp"
    code = main(
        [
            "compare",
            "--modes",
            ",".join(modes),
            "--server-args",
            f"--model {tiny_model} {SERVER_ARGS}",
            "--tokenizer",
            str(tiny_model),
            "--workload",
            "mixed",
            "--num-prompts",
            "6",
            "--request-rate",
            "4",
            "--seed",
            "0",
            "--long-fraction",
            "0.34",
            "--chat-input-len",
            "16:32",
            "--chat-output-len",
            "16:24",
            "--long-input-len",
            "600:700",
            "--long-output-len",
            "2:3",
            "--long-prompt-tokens",
            "500",
            "--goodput",
            "ttft:5000",
            "--health-timeout",
            "300",
            "--no-progress",
            "--report",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads((out / "compare.json").read_text())
    assert [row["name"] for row in data["rows"]] == modes
    for row in data["rows"]:
        assert row["error"] is None and row["completed"] == 6, row
    for mode in modes:
        run = data["runs"][mode]
        # Exact lengths reach the server: it counts the same prompt tokens we built.
        reported = [r["num_prompt_tokens_reported"] for r in run["pdserve"]["records"]]
        assert reported == run["input_lens"]
        assert run["output_lens"] == [r["output_len"] for r in run["pdserve"]["records"]]
        assert (out / f"itl_timeline-{mode}.png").is_file()
        assert "Traceback" not in (out / "logs" / f"server-{mode}.log").read_text()
    assert (out / "report.md").is_file() and "Recommendation:" in printed
