"""The search for the highest rate meeting the SLOs: its logic on a known attainment curve,
its early stop, and against the stub server with a known capacity."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.bench.cli import main
from pdserve.bench.search import RateSearch, search_max_rate
from pdserve.workload.errors import BenchError
from pdserve.workload.goodput import SearchPoint, SearchResult
from pdserve.workload.metrics import has_missed_slos
from tests.bench.conftest import REPO_ROOT
from tests.bench.helpers import failed, record


def _search(capacity: float, first_rate: float, config: RateSearch):
    """Search a server that meets the SLOs for all requests up to `capacity`, none above;
    each run takes one second of a fake clock."""
    tried, now = [], [0.0]

    def point(rate: float) -> SearchPoint:
        return SearchPoint(rate, 10 if rate <= capacity else 0, 10)

    async def measure(rate: float) -> SearchPoint:
        tried.append(rate)
        now[0] += 1.0
        return point(rate)

    search = search_max_rate(point(first_rate), measure, config, clock=lambda: now[0])
    return asyncio.run(search), tried


@pytest.mark.parametrize("capacity", [0.3, 2.9, 3.0, 11.0])
def test_the_search_brackets_the_capacity_within_one_step(capacity):
    config = RateSearch(step=1.25, max_runs=10)
    result, tried = _search(capacity, 1.0, config)
    assert result.max_rate <= capacity < result.min_missed_rate
    assert result.min_missed_rate / result.max_rate <= config.step
    assert result.stop_reason == "bracketed within 1.25x"
    assert len(tried) <= 7


def test_the_search_is_bounded_by_runs_time_and_the_floor():
    result, tried = _search(100.0, 1.0, RateSearch(max_runs=2))
    assert tried == [2.0, 4.0] and result.max_rate == 4.0 and result.min_missed_rate is None
    assert result.stop_reason.startswith("run limit") and result.describe().startswith(">= 4")
    # Runs of 1 s in a 2.5 s budget: a third would end at 3 s, so it does not start.
    result, tried = _search(100.0, 1.0, RateSearch(max_runs=10, budget_s=2.5))
    assert len(tried) == 2 and result.stop_reason == "time budget (2.5 s)"
    result, tried = _search(0.01, 1.0, RateSearch(max_runs=10))
    assert tried == [0.5, 0.25, 0.125, 0.0625] and result.max_rate is None
    assert result.describe() == "none down to 0.0625 req/s"


def test_a_met_rate_above_a_missed_one_does_not_count():
    points = (SearchPoint(1.0, 10, 10), SearchPoint(2.0, 5, 10), SearchPoint(4.0, 10, 10))
    result = SearchResult(0.9, points)
    assert (result.max_rate, result.min_missed_rate) == (1.0, 2.0)
    assert SearchResult(0.5, points).max_rate == 4.0  # the target decides what "met" means


def test_search_config_is_checked():
    with pytest.raises(BenchError, match="--slo-attainment"):
        RateSearch(attainment=0.0)
    with pytest.raises(BenchError, match="--search-step"):
        RateSearch(step=1.0)
    with pytest.raises(BenchError, match="--search-max-runs"):
        RateSearch(max_runs=0)


def test_a_run_is_hopeless_once_more_requests_missed_than_allowed():
    """Of 20 requests at a 90% target, 2 may miss; the third decides the run."""
    slos = {"ttft": 100.0, "max_itl": 50.0}
    hopeless = RateSearch(attainment=0.9).is_hopeless(slos)
    waiting = record(0, send=0.0, ttft=0.5, gaps=[0.01])
    waiting.token_times, waiting.end_time = [], None  # sent at 0, no token yet
    assert not has_missed_slos(waiting, slos, now=0.05)
    assert has_missed_slos(waiting, slos, now=0.2)  # its TTFT is already over 100 ms
    streaming = record(1, send=0.0, ttft=0.05, gaps=[0.01, 0.01])
    streaming.end_time = None
    assert not has_missed_slos(streaming, slos, now=0.08)
    assert has_missed_slos(streaming, slos, now=0.2)  # its current gap is already 130 ms
    fine = [record(i, send=0.0, ttft=0.01, gaps=[0.01]) for i in range(17)]
    misses = [failed(17, 0.0, 0.1), failed(18, 0.0, 0.1)]
    assert not hopeless([*fine, *misses, waiting], now=0.05)
    assert hopeless([*fine, *misses, waiting], now=0.2)


@pytest.mark.slow
def test_rate_search_against_a_stub_with_a_known_capacity(tmp_path, tokenizer_json, capsys):
    """Prefills one at a time, 100 ms each: the stub serves at most 10 requests per second.
    With near-regular arrivals and a 250 ms TTFT SLO, 90% of the requests meet it up to just
    above 10 req/s (each run lasts 5 s, so about 50 requests there and the 45th may wait
    150 ms: 10.3 req/s): the search must land within one step of that."""
    out = tmp_path / "search"
    code = main(
        [
            "compare",
            "--modes",
            "stub",
            "--server-cmd",
            "{python} -m tests.bench.stub_server --host {host} --port {port}",
            "--server-args",
            "--serial-prefill --ttft-ms 100 --itl-ms 5",
            "--cores",
            "1",  # one engine: 10 requests/s
            "--health-timeout",
            "60",
            "--tokenizer",
            str(tokenizer_json),
            "--workload",
            "random",
            "--num-prompts",
            "20",
            "--input-len",
            "16",
            "--output-len",
            "3",
            "--request-rate",
            "4",
            "--burstiness",
            "100",
            "--goodput",
            "ttft:250",
            "--search-rate",
            "--search-max-runs",
            "8",
            "--no-progress",
            "--report",
            str(out),
        ],
    )
    assert code == 0, capsys.readouterr().err
    data = json.loads((out / "compare.json").read_text())
    search = data["search"]["stub"]
    step = data["config"]["search"]["step"]
    low, high = search["max_rate"], search["min_missed_rate"]
    assert low is not None and high is not None and high / low <= step * 1.001
    assert 10.0 / step <= low <= 10.5 and 10.0 <= high <= 10.5 * step
    # A search run keeps the first run's span: more requests at a higher rate.
    counts = {run["request_rate"]: run["num_prompts"] for run in search["runs"]}
    assert counts[8.0] == 40
    assert data["rows"][0]["max_rate"] == low
    # Runs far above the capacity stop as soon as they are decided.
    assert any(p["is_stopped_early"] for p in search["points"] if p["rate"] > 14)
    assert len(search["runs"]) == len(search["points"]) - 1
    assert (out / "slo_attainment.png").is_file()
    assert "## Highest rate meeting the SLOs" in (out / "report.md").read_text()
    assert "highest rate meeting the SLOs" in capsys.readouterr().out


def test_search_needs_slos_and_a_finite_rate(capsys):
    base = ["compare", "--modes", "chunked", "--search-rate", "--workload", "random"]
    assert main([*base, "--request-rate", "2"]) == 2
    assert "--search-rate needs SLOs" in capsys.readouterr().err
    assert main([*base, "--request-rate", "inf", "--goodput", "ttft:10"]) == 2
    assert "finite --request-rate" in capsys.readouterr().err


def test_repo_root_is_where_the_stub_lives():
    assert (REPO_ROOT / "tests" / "bench" / "stub_server.py").is_file()
