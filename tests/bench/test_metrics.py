"""Metric definitions on records with known timelines (exact arithmetic, no server)."""

import numpy as np
import pytest

from pdserve.workload.errors import BenchError
from pdserve.workload.metrics import compute_metrics, meets_slos, parse_goodput
from tests.bench.helpers import failed, record


def test_metrics_follow_vllm_definitions():
    records = [
        record(0, send=0.0, ttft=0.1, gaps=[0.02, 0.04, 0.03]),  # 4 tokens
        record(1, send=0.5, ttft=0.3, gaps=[0.05]),  # 2 tokens
        record(2, send=1.0, ttft=0.2, gaps=[]),  # 1 token: no TPOT
        failed(3, send=1.2, end=1.3),
    ]
    m = compute_metrics(records, {})
    # Wall time: first send (0.0) to last completion (record 2's token at 1.2, failure at 1.3).
    assert m.duration == pytest.approx(1.3)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_output_tokens == 7
    assert m.total_input_tokens == 300
    assert m.request_throughput == pytest.approx(3 / 1.3)
    assert m.output_throughput == pytest.approx(7 / 1.3)
    assert m.total_token_throughput == pytest.approx(307 / 1.3)
    assert m.ttft.mean == pytest.approx(200.0)
    assert m.ttft.median == pytest.approx(200.0)
    # ITL pools every gap of every request.
    itls = np.array([20.0, 40.0, 30.0, 50.0])
    assert m.itl.mean == pytest.approx(itls.mean())
    assert m.itl.p99 == pytest.approx(np.percentile(itls, 99))
    assert m.itl.p90 == pytest.approx(np.percentile(itls, 90))
    assert m.itl.std == pytest.approx(itls.std())
    assert m.itl.max == pytest.approx(50.0)
    # TPOT = (E2EL - TTFT) / (n - 1), only for requests with more than one token.
    tpots = np.array([90.0 / 3, 50.0])
    assert m.tpot.mean == pytest.approx(tpots.mean())
    assert m.e2el.max == pytest.approx(350.0)
    assert m.request_goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        record(0, send=0.0, ttft=0.1, gaps=[0.02, 0.02]),  # ttft 100, tpot 20, e2el 140
        record(1, send=0.0, ttft=0.5, gaps=[0.02, 0.02]),  # ttft 500
        record(2, send=0.0, ttft=0.1, gaps=[0.08, 0.08]),  # tpot 80
        failed(3, send=0.0, end=1.0),
    ]
    m = compute_metrics(records, {"ttft": 200.0, "tpot": 50.0})
    assert m.num_good == 1
    assert m.request_goodput == pytest.approx(1 / m.duration)
    assert compute_metrics(records, {"e2el": 300.0}).num_good == 2
    assert not meets_slos(records[3], {"ttft": 1e9})


def test_max_itl_fails_a_request_whose_longest_gap_is_too_long():
    """TPOT averages a freeze over the answer; the stall SLO does not."""
    frozen = record(0, send=0.0, ttft=0.1, gaps=[0.02] * 20 + [0.5])  # TPOT 43 ms
    steady = record(1, send=0.0, ttft=0.1, gaps=[0.05] * 21)
    slos = parse_goodput(["tpot:60", "max_itl:100"])
    assert not meets_slos(frozen, slos) and meets_slos(steady, slos)
    assert meets_slos(frozen, {"tpot": 60.0})
    m = compute_metrics([frozen, steady, failed(2, 0.0, 1.0)], slos)
    assert (m.num_good, m.slo_attainment) == (1, pytest.approx(1 / 3))
    assert compute_metrics([steady], {}).slo_attainment is None
    assert meets_slos(record(3, 0.0, 0.1, []), {"max_itl": 1.0})  # one token: no gap


def test_a_one_token_request_meets_any_tpot_slo():
    assert meets_slos(record(0, 0.0, 0.1, []), {"tpot": 1.0})


def test_no_records_give_zero_metrics_not_errors():
    m = compute_metrics([], {"ttft": 10})
    assert (m.completed, m.duration, m.request_throughput, m.request_goodput) == (0, 0.0, 0.0, 0.0)


def test_vllm_key_names():
    keys = compute_metrics([record(0, 0.0, 0.1, [0.02])], {}).to_vllm_dict()
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in keys
    for key in (
        "completed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
    ):
        assert key in keys


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:1e4", "max_itl:800"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 10000.0,
        "max_itl": 800.0,
    }
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(BenchError, match="--goodput"):
            parse_goodput(bad)
