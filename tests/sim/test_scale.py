"""`pdserve simulate scale`: a demo's results directory in, the re-predicted table and the
fleets' goodput per core out (on a demo made here from known step times)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.demo import MachineProfile, size_demo
from pdserve.cli import main
from pdserve.core.config import Mode
from pdserve.sim import scale
from pdserve.sim.calibration import StepSample, save_samples
from pdserve.sim.cost_model import CostModel, SeqWork
from tests.sim.test_calibration import CPU, SMOL, TRUTH, _batches

MODES = [mode.value for mode in Mode]


def test_the_lines_cross_where_the_best_mode_per_core_changes():
    def fleet(*leaders):
        return {
            str(size): {m: {"per_core": 2.0 if m == best else 1.0} for m in MODES}
            for size, best in zip((4, 8, 16), leaders, strict=True)
        }

    assert scale.crossing(fleet("chunked", "chunked", "disagg"), "cores") == (
        "The lines cross: disagg overtakes chunked between 8 and 16 cores."
    )
    assert scale.crossing(fleet("chunked", "chunked", "chunked"), "GPUs") == (
        "The lines do not cross: chunked leads at every size."
    )


def test_capacities_within_the_searchs_resolution_are_level_not_a_crossing():
    """Two capacities one bracket apart are a tie: no mode overtakes another there."""
    near = 1.5 * (scale.SEARCH_RESOLUTION + 1) / 2  # within the resolution of 1.5
    fleet = {
        "4": {"chunked": {"per_core": 1.5}, "disagg": {"per_core": 1.2}},
        "8": {"chunked": {"per_core": 1.5}, "disagg": {"per_core": near}},
        "16": {"chunked": {"per_core": 1.5}, "disagg": {"per_core": 1.0}},
    }
    text = scale.crossing(fleet, "cores")
    assert text.startswith("The lines do not cross within the search's resolution.")
    assert "disagg and chunked are level at 8 cores" in text
    fleet["16"]["disagg"]["per_core"] = 2.0
    assert scale.crossing(fleet, "cores").startswith(
        "The lines cross: disagg overtakes chunked between 4 and 16 cores."
    )


def test_a_capacity_at_the_search_ceiling_decides_no_crossing():
    """A lower bound is no ranking: the size it is at is left open, not read as a lead."""
    fleet = {
        "4": {"chunked": {"per_core": 1.0}, "disagg": {"per_core": 2.0}},
        "8": {"chunked": {"per_core": 16.8, "is_bound": True}, "disagg": {"per_core": 2.1}},
    }
    assert scale.crossing(fleet, "cores") == (
        "The lines do not cross: disagg leads at every size decided. At 8 cores a capacity "
        "reached the search's ceiling (a lower bound), so the ranking there is left open."
    )


def _demo_dir(tmp_path):
    """What `bench demo` leaves: its sizing, its compare.json rows and searches (met at the
    offered rate, missed at 1.5 times it, each at two seeds), its servers' step logs."""
    truth = CostModel(SMOL, CPU, efficiency=TRUTH)
    # The probe's figures as the truth's steps make them (the machine the steps came from).
    prefill = tuple(truth.step_time((SeqWork(n, 0, True),)) for n in (768, 3072))
    decode = [truth.step_time((SeqWork(1, 256, True),) * b) for b in (1, 8)]
    profile = MachineProfile("colocated", 5.0, (768, 3072), prefill, *decode)
    plan = size_demo(profile, 600, 3, num_cores=2)
    (tmp_path / "sizing.json").write_text(json.dumps(plan.to_dict()))
    rate, count = plan.request_rate, plan.workload.num_prompts
    points = [
        {"rate": rate * f, "num_good": good, "num_requests": round(count * f), "goodput": 0.0,
         "is_stopped_early": False, "seed": seed}
        for f, good in ((1.0, round(count * 0.95)), (1.5, 0))
        for seed in (0, 1)
    ]  # fmt: skip
    search = {"slo_attainment": 0.9, "points": points}
    rows = [
        {"name": mode, "layout": layout, "max_rate": 0.5, "min_missed_rate": 0.75,
         "ttft_p99": 3000.0, "itl_p99": 200.0}
        for mode, layout in (
            ("colocated", "2 colocated replicas"),
            ("chunked", "2 chunked replicas"),
            ("disagg", "1 prefill + 1 decode"),
        )
    ]  # fmt: skip
    searches = dict.fromkeys(MODES, search)
    (tmp_path / "compare.json").write_text(json.dumps({"rows": rows, "search": searches}))
    (tmp_path / "steps").mkdir()
    save_samples(
        [StepSample(b, truth.step_time(b)) for b in _batches()],
        tmp_path / "steps" / "steps-chunked.decode-0.jsonl",
    )
    return tmp_path


@pytest.mark.slow
def test_scale_repredicts_the_demo_and_sizes_the_fleets(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scale, "FLEET_SIZES", (4, 8))
    monkeypatch.setattr(scale, "MIN_PROMPTS_PER_CORE", 3)
    demo = _demo_dir(tmp_path)
    assert main(["simulate", "scale", str(demo), "--quiet"]) == 0
    printed = capsys.readouterr().out
    data = json.loads((demo / "scale.json").read_text())
    rate = json.loads((demo / "sizing.json").read_text())["request_rate"]
    measured = f"{rate:.3g}-{rate * 1.5:.3g}"
    assert f"| colocated | 2 colocated replicas | {measured} |" in printed
    assert [row["mode"] for row in data["repredicted"]] == MODES
    for row in data["repredicted"]:
        assert row["max_rate"] == [rate, rate * 1.5]
        assert row["runs_alike"][1] == 4  # every measured run replayed
        assert row["predicted_max_rate"] > 0
    fleet = data["cpu_fleet"]
    assert list(fleet) == ["4", "8"] and "gpu_fleet" not in data  # GPUs with --gpu only
    for size, best in fleet.items():
        assert set(best) == set(MODES)
        assert best["disagg"]["per_core"] == best["disagg"]["capacity"] / int(size)
        assert not any(entry["is_bound"] for entry in best.values())  # sustained load
    assert printed.count("The lines") == 1  # cross, or not
    assert (demo / "scale.png").is_file() and (demo / "calibration.json").is_file()


@pytest.mark.slow
def test_the_gpu_fleet_is_judged_at_slos_of_its_own_speed(tmp_path, monkeypatch, capsys):
    """The demo's SLO rule on the GPU's predicted steps: far tighter than this machine's, so
    the GPU's capacities are found, not left at the search's ceiling."""
    monkeypatch.setattr(scale, "FLEET_SIZES", (4,))
    monkeypatch.setattr(scale, "MIN_PROMPTS_PER_CORE", 3)
    monkeypatch.setattr(scale, "MAX_GPU_PROMPTS", 40)
    demo = _demo_dir(tmp_path)
    assert main(["simulate", "scale", str(demo), "--gpu", "--quiet"]) == 0
    data = json.loads((demo / "scale.json").read_text())
    cpu_slos = json.loads((demo / "sizing.json").read_text())["slos_ms"]
    assert all(data["gpu_slos_ms"][name] < cpu_slos[name] / 4 for name in cpu_slos)
    assert not any(entry["is_bound"] for entry in data["gpu_fleet"]["4"].values())
