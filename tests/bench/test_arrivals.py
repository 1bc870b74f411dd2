"""Arrival processes: right mean rate, right shape, reproducible."""

import math

import numpy as np
import pytest

from pdserve.workload.arrivals import ArrivalProcess, parse_request_rates
from pdserve.workload.errors import BenchError

N = 20_000


def _gaps(process: ArrivalProcess, seed: int = 0) -> np.ndarray:
    times = process.sample(N, np.random.default_rng(seed))
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    return np.diff(times)


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_poisson_has_the_requested_mean_rate_and_exponential_gaps(rate):
    process = ArrivalProcess(rate)
    assert process.kind == "poisson"
    gaps = _gaps(process)
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.03)
    # Exponential gaps: coefficient of variation 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_the_mean_rate_and_changes_the_spread(burstiness):
    process = ArrivalProcess(2.0, burstiness)
    assert process.kind == "gamma"
    gaps = _gaps(process)
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    # Gamma with shape k: coefficient of variation 1/sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_infinite_rate_sends_everything_at_once():
    process = ArrivalProcess(math.inf)
    assert process.kind == "all-at-once"
    assert not process.sample(5, np.random.default_rng(0)).any()


def test_same_seed_same_arrivals():
    a = ArrivalProcess(3.0).sample(100, np.random.default_rng(7))
    b = ArrivalProcess(3.0).sample(100, np.random.default_rng(7))
    c = ArrivalProcess(3.0).sample(100, np.random.default_rng(8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_parse_request_rates():
    assert parse_request_rates("0.5,1,2,4") == [0.5, 1.0, 2.0, 4.0]
    assert parse_request_rates("inf") == [math.inf]
    for bad in ("0", "-1", "fast", "1,,2", "nan"):
        with pytest.raises(BenchError, match="--request-rate"):
            parse_request_rates(bad)


def test_bad_process_parameters_name_the_option():
    with pytest.raises(BenchError, match="--burstiness"):
        ArrivalProcess(1.0, 0.0)
    with pytest.raises(BenchError, match="--request-rate"):
        ArrivalProcess(0.0)
