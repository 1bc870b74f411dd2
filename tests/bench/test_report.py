"""Report artefacts and result files from hand-made runs (no server needed)."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.workload import RandomWorkload
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.records import RequestRecord
from pdserve.workload.report import server_breakdown, write_report
from pdserve.workload.results import save_results
from pdserve.workload.run import BenchSpec, summarize
from pdserve.workload.summary import format_summary
from tests.bench.test_interference import _long_prompt, _stream

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(label: str, rate: float, stall: bool, slos=None):
    spec = BenchSpec(EndpointConfig(), RandomWorkload(), slos=slos or {})
    records = [_stream(i, (0.55, 1.1) if stall else None) for i in range(3)] + [_long_prompt()]
    records[0].server_extra = {"pdserve_timing": {"prefill_ms": 12.5, "note": "x"}, "tag": True}
    return summarize(label, "m", spec, rate, records, t0=0.0)


def _assert_png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 5000


def test_single_run_report(tmp_path):
    result = _result("colocated", math.inf, stall=True)
    path = write_report([result], tmp_path, "title")
    text = path.read_text()
    for name in ("ttft_cdf.png", "itl_cdf.png", "itl_timeline-colocated.png"):
        _assert_png(tmp_path / name)
        assert f"]({name})" in text
    assert not (tmp_path / "goodput_vs_rate.png").exists()
    assert result.interference.verdict in text
    assert "| pdserve_timing.prefill_ms | 12.50 |" in text
    assert "| ITL |" in text


def test_sweep_report_plots_goodput_against_rate(tmp_path):
    results = [_result(f"rate={r}", r, stall=r > 1, slos={"ttft": 100}) for r in (0.5, 1, 2)]
    text = write_report(results, tmp_path, "sweep").read_text()
    _assert_png(tmp_path / "goodput_vs_rate.png")
    assert "## Rate sweep" in text
    assert text.count("| 0.5 |") == 1


def test_result_json_has_vllm_keys_and_pdserve_records(tmp_path):
    result = _result("run", math.inf, stall=True, slos={"e2el": 10_000})
    path = save_results([result], tmp_path / "r.json")

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(path.read_text(), parse_constant=no_constants)
    assert data["request_rate"] == "inf"
    assert data["completed"] == 4
    assert data["request_goodput"] == pytest.approx(4 / result.metrics.duration)
    assert len(data["itls"]) == 4 and len(data["ttfts"]) == 4
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "std_itl_ms"):
        assert key in data
    pdserve = data["pdserve"]
    assert pdserve["config"]["workload"]["name"] == "random"
    assert pdserve["interference"]["is_interference"]
    records = [RequestRecord.from_dict(r) for r in pdserve["records"]]
    assert records == result.records


def test_a_sweep_is_saved_as_a_list(tmp_path):
    results = [_result("a", 1.0, False), _result("b", 2.0, False)]
    data = json.loads(save_results(results, tmp_path / "s.json").read_text())
    assert [r["request_rate"] for r in data["sweep"]] == [1.0, 2.0]


def test_summary_fits_one_screen():
    text = format_summary(_result("run", 2.0, stall=True, slos={"ttft": 100}))
    lines = text.splitlines()
    assert len(lines) < 25
    assert "phase interference" in lines[-2]
    assert any(line.startswith("ITL ") for line in lines)


def test_server_breakdown_keeps_numbers_only():
    result = _result("run", 1.0, stall=False)
    assert server_breakdown(result.records) == {"pdserve_timing.prefill_ms": [12.5]}
