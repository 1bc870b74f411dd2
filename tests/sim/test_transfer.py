"""Calibrations that transfer: a fit on one TP's points predicts another TP of the same stack;
points from a table (`simulate calibrate --points`); a band that counts every point."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.cli import main
from pdserve.sim.calibration import Measurement, fit_efficiency, predict
from pdserve.sim.cost_model import CostModel, SeqWork, ring_all_reduce_s
from pdserve.sim.efficiency import Calibration, Efficiency
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS
from pdserve.sim.points import SOURCES_DIR, deployment, load_source, measurement
from pdserve.sim.profile_fit import calibrate_table

H100 = get_hardware("H100-SXM")
LLAMA_70B = MODELS["Llama-3-70B"]
# A stub stack's law: fixed costs per step, sequence and layer that do not shrink with TP
# (as a stack whose TP4 decode is nearly as fast as its TP8 decode), on top of the physics.
STUB = Efficiency(
    linear_compute=0.55,
    attention_compute=0.4,
    memory=0.7,
    step_overhead_s=4e-3,
    per_seq_overhead_s=20e-6,
    layer_overhead_s=60e-6,
)


def _points(tp: int) -> list[tuple[dict, Measurement]]:
    """The stub's TTFTs (128-8,192 tokens) and decode steps (batch 1-64) at `tp`."""
    model = CostModel(LLAMA_70B, H100, tp, efficiency=STUB)
    points = [{"kind": "ttft", "prompt_len": n, "front_end": False} for n in (128, 512, 2048, 8192)]
    points += [
        {"kind": "itl", "num_streams": b, "context": c, "prompt_len": c}
        for b in (1, 8, 32, 64)
        for c in (512, 4096)
    ]
    out = []
    for point in points:
        m = measurement({**point, "seconds": 1.0}, CostModel(LLAMA_70B, H100, tp))
        seconds = predict(model, m)
        out.append(({**point, "tp": tp}, measurement({**point, "seconds": seconds}, m.cost_model)))
    return out


def test_a_fit_on_part_of_one_tp_predicts_the_rest_and_another_tp():
    tp8, tp4 = _points(8), _points(4)
    fitted = [m for p, m in tp8 if p.get("prompt_len") in (128, 2048) or p.get("context") == 512]
    fit = fit_efficiency(fitted[0].cost_model, fitted, allow_curve=False)
    for point, m in tp8 + tp4:
        error = predict(m.cost_model.with_efficiency(fit.efficiency), m) / m.seconds - 1
        assert abs(error) < 0.05, (point, error)
    # TP4's decode is not twice TP8's: the fixed costs stayed fixed.
    decode = [m.seconds for p, m in tp8 + tp4 if p.get("num_streams") == 1][::2]
    assert decode[1] / decode[0] < 1.6


def test_the_band_counts_the_points_the_fit_set_aside():
    points = [m for _, m in _points(8)]
    disturbed = [
        Measurement(m.steps, m.seconds * 3, m.num_requests, m.cost_model, "disturbed")
        for m in points[:2]
    ]
    fit = fit_efficiency(points[0].cost_model, points + disturbed, allow_curve=False)
    assert fit.num_outliers == 2 and not any(fit.kept[-2:])
    assert fit.kept_band < 0.05
    # Two points in fourteen missed by ~-67%: the 90th percentile over all of them sees them.
    assert fit.band > 0.3


def test_a_fit_ending_at_the_peak_is_reported():
    # Decode steps faster than the weights can stream at 100% of bandwidth.
    model = CostModel(LLAMA_70B, H100, 8)
    fast = [
        Measurement(((1, (SeqWork(1, 512),) * b),), 0.3 * model.step_time((SeqWork(1, 512),) * b))
        for b in (1, 4, 16, 64)
    ]
    fit = fit_efficiency(model, fast, allow_curve=False)
    assert "memory" in fit.at_bound
    assert fit.metadata()["at_bound"] == list(fit.at_bound)


@pytest.mark.parametrize(
    ("source", "hardware"), [("trtllm-perf-v0.6", "H100-SXM"), ("vidur-linear", "A100-80GB")]
)
def test_points_round_trip_a_shipped_source_with_a_hold_out(source, hardware, tmp_path, capsys):
    out = tmp_path / "mine.json"
    path = SOURCES_DIR / f"{source}.json"
    args = ["simulate", "calibrate", "--points", str(path), "--hardware", hardware]
    assert main([*args, "--hold-out", "tp=4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held out, not fitted" in printed
    calibration = Calibration.load(out)
    rows = calibration.metadata["points"]
    mine = [p for p in load_source(source)["points"] if p["hardware"] == hardware]
    measured = {m.label: (p, m) for p in mine for m in [measurement(p, deployment(p))]}
    assert len(rows) == len(mine) == len(measured)
    assert {r["label"] for r in rows if r.get("held_out")} == {
        label for label, (p, _) in measured.items() if p["tp"] == 4
    }
    # Every row is what the saved calibration predicts for its point.
    for row in rows:
        m = measured[row["label"]][1]
        predicted = predict(m.cost_model.with_efficiency(calibration.efficiency), m)
        assert predicted == pytest.approx(row["predicted_s"], rel=1e-6)


def test_points_bad_input_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": "none"}))
    args = ["simulate", "calibrate", "--hardware", "H100-SXM", "--output", str(tmp_path / "x")]
    assert main([*args, "--points", str(bad)]) == 2
    assert "--points" in capsys.readouterr().err
    path = SOURCES_DIR / "trtllm-perf-v0.6.json"
    assert main([*args, "--points", str(path), "--hold-out", "tp"]) == 2
    assert "--hold-out" in capsys.readouterr().err


def test_kernel_profiles_fitted_at_one_tp_predict_the_sharded_kernels():
    # Each layer's linears pay a launch time that sharding does not shrink: at TP8 the
    # small-batch kernels are mostly that time (Vidur's profiles: -45% without the term).
    points = {
        tp: [
            {"kind": "linear_layer", "num_tokens": n, "tp": tp, "model": "Llama-3-70B"}
            for n in (1, 8, 32, 128, 512, 2048)
        ]
        for tp in (1, 8)
    }

    def measured(point):
        model = CostModel(LLAMA_70B, H100, point["tp"])
        truth = model.with_efficiency(STUB)
        seconds = truth.layers_linear_s(point["num_tokens"]) / LLAMA_70B.num_layers
        return measurement({**point, "seconds": seconds}, model)

    fitted = [measured(p) for p in points[1]]
    fit = fit_efficiency(fitted[0].cost_model, fitted, allow_curve=False)
    assert fit.efficiency.layer_overhead_s == pytest.approx(STUB.layer_overhead_s, rel=0.1)
    for point in points[8]:
        m = measured(point)
        error = predict(m.cost_model.with_efficiency(fit.efficiency), m) / m.seconds - 1
        assert abs(error) < 0.05, (point, error)


def test_the_stacks_own_all_reduces_set_its_communication():
    # A stack whose collectives reach half the link's measured share of line rate.
    slow = dataclasses.replace(STUB, network=0.5)
    model = CostModel(LLAMA_70B, H100, 8)
    link = model.tp_link
    collectives = [
        {
            "kind": "all_reduce",
            "num_gpus": n,
            "bytes": b,
            "seconds": ring_all_reduce_s(b, n, link.achieved_bandwidth * 0.5, link.latency_s),
        }
        for n in (4, 8)
        for b in (2**20, 2**24, 2**26)
    ]
    truth = model.with_efficiency(slow)
    points = [
        {**p, "seconds": predict(truth, m)}
        for p, m in _points(8)
        for p in [{k: v for k, v in p.items() if k != "tp"}]
    ]
    fit, rows, held = calibrate_table(points + collectives, model, None)
    assert fit.efficiency.network == pytest.approx(0.5, rel=0.02)
    assert max(abs(r["residual"]) for r in rows) < 0.05 and not held


def test_a_calibration_at_a_bound_says_so_when_loaded(tmp_path, capsys):
    model = CostModel(LLAMA_70B, H100, 8)
    fast = [
        {"kind": "itl", "num_streams": b, "context": 512, "prompt_len": 512, "seconds": s}
        for b in (1, 4, 16, 64)
        for s in [0.3 * model.step_time((SeqWork(1, 512),) * b)]
    ]
    table = tmp_path / "fast.json"
    table.write_text(json.dumps(fast))
    out = tmp_path / "fast-cal.json"
    args = ["simulate", "calibrate", "--points", str(table), "--hardware", "H100-SXM"]
    assert main([*args, "--model", "Llama-3-70B", "--tp", "8", "--output", str(out)]) == 0
    assert "fitted at 100% of peak" in capsys.readouterr().out
    assert "at 100% of peak: memory" in Calibration.load(out).describe()
    assert main(["simulate", "calibrate", "--bench", str(table), "--hold-out", "tp=4"]) == 2
    assert "--hold-out goes with --points" in capsys.readouterr().err
