"""`bench compare` end to end, with the stub server standing in for each serving mode."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.cli import main
from pdserve.bench.compare import recommend
from pdserve.bench.layout import disagg_split, mode_layout, parse_external, parse_split
from pdserve.workload.errors import BenchError
from pdserve.workload.table import CompareRow, Layout, format_table
from tests.bench.conftest import REPO_ROOT, running_stub

SCHEDULE = "--ttft-ms 30 --itl-ms 15 --long-prompt-words 250 --long-ttft-ms 400"
WORKLOAD_ARGS = [
    "--workload",
    "mixed",
    "--num-prompts",
    "10",
    "--request-rate",
    "10",
    "--seed",
    "3",
    "--long-fraction",
    "0.2",
    "--chat-input-len",
    "16:32",
    "--chat-output-len",
    "40:60",
    "--long-input-len",
    "300:350",
    "--long-output-len",
    "2:3",
    "--long-prompt-tokens",
    "250",
]


@pytest.mark.slow
def test_compare_runs_every_mode_and_writes_all_artefacts(
    tmp_path, tokenizer_json, monkeypatch, capsys
):
    monkeypatch.chdir(REPO_ROOT)
    out = tmp_path / "cmp"
    with running_stub(tmp_path / "ext", *SCHEDULE.split(), "--mode", "colocated") as ext_url:
        code = main(
            [
                "compare",
                *WORKLOAD_ARGS,
                "--tokenizer",
                str(tokenizer_json),
                "--modes",
                "colocated,chunked,disagg,broken",
                "--external",
                f"other={ext_url}",
                "--server-cmd",
                "{python} -m tests.bench.stub_server --host {host} --port {port} --mode {mode}",
                "--server-args",
                SCHEDULE,
                "--mode-args",
                "chunked=--itl-ms 12",  # the stub's chunked preset doubles it: 24 ms, not 30
                "--health-timeout",
                "60",
                "--goodput",
                "tpot:20",
                "--no-progress",
                "--report",
                str(out),
            ]
        )
    printed = capsys.readouterr().out
    assert code == 0

    data = json.loads((out / "compare.json").read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["colocated", "chunked", "disagg", "broken", "other"]
    assert "exited with code 2" in rows["broken"]["error"]
    for name in ("colocated", "chunked", "disagg", "other"):
        assert rows[name]["completed"] == 10 and rows[name]["failed"] == 0
        assert data["runs"][name]["pdserve"]["config"]["seed"] == 3
        assert (out / f"itl_timeline-{name}.png").is_file()
        assert (out / "logs" / f"server-{name}.log").is_file() or name == "other"
    assert data["config"]["mode_args"] == {"chunked": ["--itl-ms", "12"]}
    assert rows["chunked"]["itl_p50"] < 28 < rows["colocated"]["itl_p50"] * 2
    # The same requests everywhere.
    input_lens = {tuple(run["input_lens"]) for run in data["runs"].values()}
    assert len(input_lens) == 1
    # The stalling modes are diagnosed; the clean one is not.
    assert rows["colocated"]["is_interference"] and rows["other"]["is_interference"]
    assert rows["colocated"]["itl_max"] > 300
    assert not rows["disagg"]["is_interference"] and rows["disagg"]["itl_max"] < 300
    assert rows["disagg"]["goodput"] >= rows["colocated"]["goodput"]
    # On every core here: chunked's replicas share out the long prompts, and may tie.
    assert data["recommendation"]["name"] in ("disagg", None)
    assert "phase interference in colocated" in data["recommendation"]["reason"]
    assert (
        rows["colocated"]["num_cores"] == rows["disagg"]["num_cores"] == data["config"]["num_cores"]
    )

    report = (out / "report.md").read_text()
    assert "| mode | layout | cores | ok | TTFT p50 |" in report
    assert "other not ranked: its cores" in report
    for name in ("ttft_cdf.png", "itl_cdf.png", "report.md"):
        assert (out / name).is_file()
    assert "Recommendation: " in printed
    assert "TTFT p99" in printed and "broken: failed to run" in printed

    # Saved runs are judged again from their records: the same rows, recommendation, report
    # and plots as the measured compare.
    again_dir = tmp_path / "again"
    saved_args = ["compare", "--modes", "", "--saved", f"again={out / 'compare.json'}"]
    assert main([*saved_args, "--report", str(again_dir)]) == 0
    printed_again = capsys.readouterr().out
    again = json.loads((again_dir / "compare.json").read_text())
    again_rows = {row["name"]: row for row in again["rows"]}
    assert list(again_rows) == [
        f"again/{name}" for name in ("colocated", "chunked", "disagg", "other")
    ]
    for name in ("colocated", "chunked", "disagg", "other"):
        row, measured = again_rows[f"again/{name}"], rows[name]
        for key in ("completed", "itl_p99", "goodput", "is_interference", "finding", "verdict"):
            assert row[key] == measured[key], (name, key)
        assert (again_dir / f"itl_timeline-again-{name}.png").is_file()
    recommended = data["recommendation"]["name"]
    assert again["recommendation"]["name"] == (recommended and f"again/{recommended}")
    assert again_rows["again/disagg"]["layout"] == rows["disagg"]["layout"]
    assert "again/other not ranked" in again["recommendation"]["reason"]
    assert "again/colocated" in printed_again
    # ... and with other SLOs, judged by those.
    strict = tmp_path / "strict"
    assert main([*saved_args, "--goodput", "ttft:1", "--report", str(strict)]) == 0
    capsys.readouterr()
    verdict = json.loads((strict / "compare.json").read_text())["recommendation"]
    assert verdict["name"] is None and verdict["reason"].startswith("none at this load")


def test_mode_args_must_name_a_compared_mode(capsys):
    args = ["compare", *WORKLOAD_ARGS, "--modes", "chunked", "--mode-args", "disagg=--x 1"]
    assert main(args) == 2
    assert "--mode-args: 'disagg' is not one of --modes" in capsys.readouterr().err
    assert main(["compare", *WORKLOAD_ARGS, "--modes", "chunked", "--mode-args", "chunked"]) == 2
    assert "--mode-args: expected NAME=ARGS" in capsys.readouterr().err


def test_saved_rows_reject_what_is_not_one_run(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"sweep": [{}, {}]}))
    assert main(["compare", "--modes", "", "--saved", f"s={sweep}"]) == 2
    assert "save one rate" in capsys.readouterr().err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"completed": 3}))
    assert main(["compare", "--modes", "", "--saved", f"p={partial}"]) == 2
    assert "not a saved benchmark run" in capsys.readouterr().err
    assert main(["compare", "--modes", "", "--saved", "nameless"]) == 2
    assert "expected NAME=FILE.json" in capsys.readouterr().err


def _row(name, **kw):
    defaults = dict(completed=10, itl_p99=50.0, output_throughput=100.0, goodput=None)
    return CompareRow(name, **{**defaults, **kw})


def test_recommend_by_goodput_when_slos_are_given():
    rows = [
        _row(
            "colocated",
            goodput=0.5,
            num_good=5,
            itl_p99=900.0,
            is_interference=True,
            in_prefill_fraction=0.9,
        ),
        _row("chunked", goodput=1.2, num_good=9, itl_p99=60.0),
        _row("disagg", goodput=1.0, num_good=8, itl_p99=30.0),
    ]
    rec = recommend(rows, has_slos=True, request_rate=1.0)
    assert rec.name == "chunked"
    assert "highest goodput under the SLOs, 1.200 req/s (vs colocated 0.500, disagg 1.000)" in (
        rec.reason
    )
    assert "phase interference in colocated (90% of its stalled time" in rec.reason


def test_all_zero_goodput_recommends_nothing_and_says_why():
    rows = [_row(m, goodput=0.0, num_good=0, is_overload=True, overload_slowdown=6.0) for m in "ab"]
    rec = recommend(rows, has_slos=True, request_rate=2.0)
    assert rec.name is None
    assert rec.reason.startswith("none at this load: no mode met every SLO for any request at 2")
    assert "--search-rate" in rec.reason and "overloaded at this load" in rec.reason
    assert str(rec).startswith("Recommendation: none — none at this load")


def test_a_tie_at_a_fixed_rate_recommends_nothing():
    rows = [
        _row("colocated", goodput=0.41, num_good=7, failed=3),
        _row("chunked", goodput=0.40, num_good=7, failed=3),  # same count, other duration
        _row("disagg", goodput=0.2, num_good=4, failed=6),
    ]
    rec = recommend(rows, has_slos=True, request_rate=1.0)
    assert rec.name is None
    assert "colocated and chunked tie, 7 of 13 requests within the SLOs" in rec.reason


def _searched(name, max_rate, missed=None, **kw):
    return _row(name, is_searched=True, max_rate=max_rate, min_missed_rate=missed, **kw)


def test_searched_rows_rank_by_the_highest_rate_meeting_the_slos():
    rows = [
        _searched("colocated", 0.25, 0.35, goodput=0.0, num_good=0),
        _searched("chunked", 0.5, 0.71, goodput=0.0, num_good=0),
        _searched("disagg", 0.71, 1.0, goodput=0.0, num_good=0),
    ]
    rec = recommend(rows, has_slos=True, request_rate=1.0)
    assert rec.name == "disagg"
    assert "highest load with 90% of requests within the SLOs, 0.71 req/s" in rec.reason
    assert "(highest loads: disagg 0.71-1, chunked 0.5-0.71, colocated 0.25-0.35 req/s)" in (
        rec.reason
    )
    assert "at the offered 1 req/s no mode met every SLO" in rec.reason


def test_a_winner_only_where_its_interval_is_clear_of_every_other():
    # b's seeds disagree at 0.6: its highest rate lies in [0.4, 0.8), which a's 0.71 is not
    # clear of; a third mode that never missed cannot be beaten either.
    overlapping = [_searched("a", 0.71, 1.0), _searched("b", 0.4, 0.8), _searched("c", 0.2, 0.3)]
    rec = recommend(overlapping, has_slos=True, request_rate=0.5)
    assert rec.name is None
    assert rec.reason.startswith(
        "no clear winner on this machine: the highest loads with 90% of requests within the "
        "SLOs overlap (a 0.71-1, b 0.4-0.8, c 0.2-0.3 req/s)"
    )
    assert recommend([_searched("a", 1.0, 2.0), _searched("b", 0.5)], True).name is None
    clear = [_searched("a", 0.8, 1.0), _searched("b", 0.4, 0.8)]
    assert recommend(clear, has_slos=True).name == "a"


def test_only_rows_on_the_comparisons_cores_are_ranked():
    rows = [
        _searched("chunked", 0.5, 0.71, num_cores=2),
        _searched("disagg", 0.35, 0.5, num_cores=2),
        _searched("vllm", 2.0, 3.0),  # an --external without @CORES
        _searched("big", 4.0, 6.0, num_cores=8),
    ]
    rec = recommend(rows, has_slos=True, num_cores=2)
    assert rec.name == "chunked"
    assert "; vllm not ranked: its cores are not declared (--external NAME=URL@CORES)" in (
        rec.reason
    )
    assert "; big not ranked: it ran on 8 cores, the others on 2" in rec.reason
    # Saved rows alone: ranked on the core count most of them recorded.
    assert recommend([rows[1], rows[3], _searched("x", 0.2, 0.3, num_cores=2)], True).name == (
        "disagg"
    )


def test_external_rows_declare_their_cores():
    assert parse_external("v", "http://127.0.0.1:8100@4") == (
        "http://127.0.0.1:8100",
        Layout(None, 4, "external on 4 cores"),
    )
    url, layout = parse_external("v", "http://u:p@host:8100")
    assert url == "http://u:p@host:8100" and layout.num_cores is None
    with pytest.raises(BenchError, match="--external v: expected URL@CORES"):
        parse_external("v", "http://h@0")


def test_each_mode_gets_the_same_cores_in_its_own_layout():
    assert mode_layout("chunked", 4) == Layout(
        4, 4, "4 chunked replicas", ("--data-parallel-size", "4")
    )
    assert mode_layout("colocated", 1) == Layout(1, 1, "1 colocated engine")
    assert mode_layout("disagg", 2).description == "1 prefill + 1 decode"
    assert mode_layout("disagg", 5, (2, 3)).argv == (
        *("--prefill-workers", "2", "--decode-workers", "3"),
    )
    assert disagg_split(1) == (1, 1) and disagg_split(8, 0.25) == (2, 6)
    assert disagg_split(3, 0.05) == (1, 2) and disagg_split(3, 0.99) == (2, 1)
    assert parse_split("1:3") == (1, 3)
    with pytest.raises(BenchError, match="--disagg-split"):
        parse_split("0:2")


def test_searched_ties_and_nothing_met_recommend_nothing():
    tie = [_searched("a", 0.5, 0.71), _searched("b", 0.5, 0.71), _searched("c", 0.25, 0.35)]
    rec = recommend(tie, has_slos=True, request_rate=0.5)
    assert rec.name is None and rec.reason.startswith("no clear winner on this machine")
    none = [_searched("a", None), _searched("b", None)]
    rec = recommend(none, has_slos=True, request_rate=0.5, attainment=0.95)
    assert rec.name is None
    assert rec.reason.startswith("none at any searched load: no mode kept 95% of requests")


def test_recommend_by_itl_among_near_best_throughput_without_slos():
    rows = [
        _row("colocated", itl_p99=900.0, output_throughput=120.0),
        _row("chunked", itl_p99=60.0, output_throughput=115.0),
        _row("disagg", itl_p99=30.0, output_throughput=80.0),  # too slow to qualify
        _row("broken", completed=0, error="did not start"),
    ]
    rec = recommend(rows, has_slos=False)
    assert rec.name == "chunked"
    assert "lowest ITL p99, 60 ms" in rec.reason and "96% of the best" in rec.reason
    assert recommend([_row("x", error="no")], has_slos=False) is None


def test_table_shows_failed_rows():
    rows = [
        _row("disagg", goodput=1.0, attainment=0.9, finding="neither"),
        _row("broken", error="boom"),
    ]
    text = format_table(rows)
    header, ok, failed = text.splitlines()
    assert header.split()[:4] == ["mode", "layout", "cores", "ok"]
    assert ok.split()[2] == "10/10" and ok.split()[-5:] == ["90%", "-", "-", "0%", "neither"]
    assert failed.split()[:4] == ["broken", "?", "failed", "-"]
    markdown = format_table([_row("disagg", layout="1 prefill + 1 decode", num_cores=2)], True)
    assert markdown.splitlines()[2].startswith("| disagg | 1 prefill + 1 decode | 2 | 10/10 |")
    searched = [_searched("a", 0.5, None, num_cores=2), _searched("b", None, 0.1)]
    a, b = format_table(searched).splitlines()[1:]
    assert ">=0.5 0.25" in " ".join(a.split()) and "none (<0.1)" in b


def test_saved_single_runs_are_judged_from_their_records(tmp_path, capsys):
    """One bench --save-result file per row, judged like measured runs (other SLOs given
    here), and a file of another tool (numbers only) shown as it is."""
    from pdserve.workload.results import save_results
    from tests.bench.test_report import _result

    save_results([_result("a", 1.0, stall=True)], tmp_path / "a.json")
    clean = save_results([_result("b", 1.0, stall=False)], tmp_path / "b.json")
    numbers = json.loads(clean.read_text())
    del numbers["pdserve"]
    (tmp_path / "other.json").write_text(json.dumps(numbers))
    out = tmp_path / "report"
    args = ["compare", "--modes", "", "--report", str(out), "--goodput", "max_itl:300"]
    for name in ("a", "b", "other"):
        args += ["--saved", f"{name}={tmp_path / (name + '.json')}"]
    assert main(args) == 0
    capsys.readouterr()
    data = json.loads((out / "compare.json").read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert rows["a"]["finding"] == "interference" and rows["a"]["attainment"] == 0.25
    assert rows["b"]["finding"] == "neither" and rows["b"]["attainment"] == 1.0
    assert rows["other"]["goodput"] is None and rows["other"]["finding"] == ""
    assert data["recommendation"]["name"] == "b"
    assert data["config"]["goodput_slos_ms"] == {"max_itl": 300.0}
    assert (out / "itl_timeline-a.png").is_file() and (out / "report.md").is_file()


SECRETS = ("sk-never-saved", "redis-pw", "worker-key", "url-pw")


def test_compare_json_and_launch_errors_name_no_secret(tmp_path):
    """API keys, passwords and URLs' credentials in the server command never reach
    compare.json or the error printed when a server does not start."""
    from pdserve.bench.compare import CompareResult, CompareSpec
    from pdserve.bench.launcher import LaunchConfig, launch_server
    from pdserve.workload import RandomWorkload
    from pdserve.workload.endpoint import COMPLETIONS, EndpointConfig
    from pdserve.workload.errors import BenchError
    from pdserve.workload.run import BenchSpec

    secret_args = ("--api-key", "sk-never-saved", "--kv-store", "redis://tenant:redis-pw@h/0")
    launch = LaunchConfig(
        command=("{python}", "-c", "import sys; sys.exit(3)"),
        extra_args=(*secret_args, "--api-key=sk-never-saved"),
        mode_args={"disagg": ("--worker-args", "--api-key worker-key --max-num-seqs 2")},
        log_dir=tmp_path,
        health_timeout_s=30,
    )
    spec = CompareSpec(
        BenchSpec(EndpointConfig("http://u:url-pw@127.0.0.1:1", COMPLETIONS), RandomWorkload()),
        launch=launch,
        externals=(("other", "http://u:url-pw@127.0.0.1:2"),),
    )
    saved = json.dumps(CompareResult(spec, {}, [], None).to_dict())
    assert not [s for s in SECRETS if s in saved], saved
    config = json.loads(saved)["config"]
    assert config["server_command"][-5:] == [
        "--api-key",
        "***",
        "--kv-store",
        "redis://tenant:***@h/0",
        "--api-key=***",
    ]
    assert config["mode_args"]["disagg"] == ["--worker-args", "--api-key '***' --max-num-seqs 2"]
    assert config["externals"] == {"other": "http://u:***@127.0.0.1:2"}
    for command in (launch.command, ("/no/such/server",)):
        failing = LaunchConfig(command=command, extra_args=secret_args, log_dir=tmp_path)
        with pytest.raises(BenchError) as failed, launch_server(failing, "disagg"):
            pass
        assert "--api-key ***" in str(failed.value) or "'***'" in str(failed.value)
        assert not [s for s in SECRETS if s in str(failed.value)], str(failed.value)
