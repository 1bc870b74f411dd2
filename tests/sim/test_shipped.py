"""The calibrations and link figures that ship with pdserve: where they come from, and that
they are what their sources give."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from pdserve.sim.calibration import fit_link, predict
from pdserve.sim.efficiency import (
    Calibration,
    Efficiency,
    default_calibration,
    shipped_calibrations,
)
from pdserve.sim.network import GBIT, NETWORKS
from pdserve.sim.points import deployment, load_source, measurement, source_names

# The shipped files' generator is a script, not part of the installed package.
_SPEC = importlib.util.spec_from_file_location(
    "gpu_calibration", Path(__file__).parents[2] / "benchmarks" / "gpu_calibration.py"
)
gpu_calibration = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_calibration"] = gpu_calibration
_SPEC.loader.exec_module(gpu_calibration)


def test_every_shipped_calibration_loads_and_names_its_sources():
    assert set(shipped_calibrations()) == set(gpu_calibration.SHIPPED)
    for name in shipped_calibrations():
        calibration = Calibration.load(name)
        assert calibration.name == name and calibration.stack
        assert 0 < calibration.band < 0.5
        for source in calibration.metadata["sources"]:
            assert source["name"] in source_names()
            assert source.get("commit") or source.get("url")
            assert source["stack"] and source["conditions"]
        assert calibration.metadata["points"]


@pytest.mark.parametrize("name", sorted(gpu_calibration.SHIPPED))
def test_shipped_calibration_reproduces_its_fitting_points(name):
    calibration = Calibration.load(name)
    hardware = calibration.metadata["hardware"]
    by_label = {
        m.label: m
        for source in calibration.metadata["sources"]
        for p in load_source(source["name"])["points"]
        if p["hardware"] == hardware
        for m in [measurement(p, deployment(p))]
    }
    kernel = Efficiency.from_dict(calibration.metadata["kernel_efficiency"], name)
    residuals = []
    for row in calibration.metadata["points"]:
        m = by_label[row["label"]]
        is_engine = row["source"] == gpu_calibration.ENGINE_SOURCE
        efficiency = calibration.efficiency if is_engine else kernel
        predicted = predict(m.cost_model.with_efficiency(efficiency), m)
        assert m.seconds == pytest.approx(row["measured_s"])
        assert predicted == pytest.approx(row["predicted_s"], rel=1e-6)
        assert predicted / m.seconds - 1 == pytest.approx(row["residual"], abs=1e-6)
        if is_engine:
            residuals.append(abs(row["residual"]))
    # The band is the 90th percentile of every engine residual: it covers nine in ten.
    within = sum(r <= calibration.band + 1e-9 for r in residuals)
    assert within >= 0.9 * len(residuals) - 1


# Refit against shipped: floating point differs in its last bits between CPUs (numpy's SIMD
# and BLAS paths), so equal means equal to this relative precision. A fit that chose
# another solution (another grid point, another set of overheads) misses it by far more.
REFIT_REL = 1e-9


@pytest.mark.parametrize("name", sorted(gpu_calibration.SHIPPED))
def test_shipped_file_is_what_its_sources_fit_to(name):
    refit = gpu_calibration.fit_shipped(name, gpu_calibration.SHIPPED[name])
    shipped = Calibration.load(name)
    refitted, saved = asdict(refit.efficiency), asdict(shipped.efficiency)
    assert refitted.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, float):
            assert refitted[key] == pytest.approx(value, rel=REFIT_REL, abs=1e-15), key
        else:
            assert refitted[key] == value, key
    assert refit.band == pytest.approx(shipped.band, rel=REFIT_REL)
    # And each fitting point predicted as the shipped file predicts it.
    assert [row["predicted_s"] for row in refit.metadata["points"]] == pytest.approx(
        [row["predicted_s"] for row in shipped.metadata["points"]], rel=REFIT_REL
    )


def test_measured_links_match_their_sources():
    points = load_source("vidur-allreduce")["points"]
    for name in ("nvlink-h100", "nvlink-a100"):
        link = NETWORKS[name]
        fit = fit_link(link.bandwidth, [p for p in points if p["link"] == name])
        assert link.measured_by == "vidur-allreduce"
        assert link.latency_s == pytest.approx(fit.latency_s, abs=1e-6)
        assert link.efficiency == pytest.approx(fit.efficiency, abs=0.01)
    for point in load_source("mooncake-te")["points"]:
        link = NETWORKS[point["link"]]
        assert link.num_lanes == point["num_nics"] and link.bandwidth == point["nic_gbps"] * GBIT
        assert link.node_bandwidth == pytest.approx(point["bytes_per_s"], rel=0.01)


def test_gpus_default_to_their_shipped_calibration():
    assert default_calibration("H100-SXM").name == "h100-sxm-trtllm"
    assert default_calibration("H200").name == "h100-sxm-trtllm"  # same chip, borrowed
    assert default_calibration("A100-80GB").name == "a100-80gb-trtllm"
    typical = default_calibration("L40S")
    assert typical.name == "typical" and typical.band is None
    assert default_calibration("cpu-local:2").band is None
