import dataclasses
import json

import numpy as np
import pytest

from pdserve.sim import calibration
from pdserve.sim.calibration import StepSample, fit_efficiency, load_samples, save_samples
from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS

CPU = get_hardware("cpu-local")
SMOL = MODELS["SmolLM2-135M"]
TRUTH = Efficiency(
    linear_compute=0.21,
    attention_compute=0.04,
    memory=0.55,
    network=1.0,
    step_overhead_s=0.006,
    per_seq_overhead_s=0.0004,
)


def _batches():
    batches = [(SeqWork(n, 0, True),) for n in (32, 128, 512, 1024, 2048)]
    batches += [(SeqWork(512, c, False),) for c in (512, 1536, 2560)]
    batches += [(SeqWork(1, c, True),) * b for b in (1, 4, 16, 48) for c in (128, 1500)]
    batches += [(SeqWork(1, 300, True),) * 8 + (SeqWork(256, 1024, False),)]
    return batches


def test_fit_recovers_known_factors():
    truth = CostModel(SMOL, CPU, efficiency=TRUTH)
    samples = [StepSample(b, truth.step_time(b)) for b in _batches()]
    fit = fit_efficiency(CostModel(SMOL, CPU), samples)
    assert fit.mean_abs_rel_error < 0.02
    assert fit.efficiency.linear_compute == pytest.approx(0.21, rel=0.1)
    assert fit.efficiency.memory == pytest.approx(0.55, rel=0.1)
    assert fit.efficiency.step_overhead_s == pytest.approx(0.006, rel=0.15)
    assert not fit.efficiency.linear_curve  # a roofline world is best told by the roofline


def test_curve_follows_a_kernel_switch_the_roofline_cannot():
    """A GEMV kernel for up to 8 rows that is slower per row than the GEMM above it (as on
    this machine with two threads): the fitted curve follows it, the roofline alone not."""
    roofline = CostModel(SMOL, CPU, efficiency=TRUTH)

    def measured(batch):
        num_rows, cost = sum(q.num_new_tokens for q in batch), roofline.step_cost(batch)
        return cost.total_s + (0.6 * cost.linear_s if 4 <= num_rows <= 8 else 0.0)

    batches = _batches() + [
        (SeqWork(1, c, True),) * b for b in range(1, 13) for c in (100, 400, 900)
    ]
    samples = [StepSample(b, measured(b)) for b in batches]
    fit = fit_efficiency(CostModel(SMOL, CPU), samples)
    assert fit.efficiency.linear_curve
    assert fit.mean_abs_rel_error < 0.02 and fit.max_abs_rel_error < 0.1
    plain = CostModel(SMOL, CPU, efficiency=dataclasses.replace(fit.efficiency, linear_curve=()))
    assert max(abs(plain.step_time(s.batch) - s.step_s) / s.step_s for s in samples) > 0.15


def test_fit_tolerates_noise():
    truth = CostModel(SMOL, CPU, efficiency=TRUTH)
    noisy = [
        StepSample(b, truth.step_time(b) * (1.05 if i % 2 else 0.95))
        for i, b in enumerate(_batches())
    ]
    fit = fit_efficiency(CostModel(SMOL, CPU), noisy)
    assert fit.mean_abs_rel_error < 0.08


def test_samples_round_trip_and_engine_bench_format(tmp_path):
    samples = [StepSample(b, 0.01) for b in _batches()[:3]]
    path = tmp_path / "steps.jsonl"
    save_samples(samples, path)
    assert load_samples(path) == samples
    bench = {
        "runs": [
            {
                "dtype": "bfloat16",
                "weight_bytes": 1,
                "prefill": {"512": {"pdserve_tokens_per_s": 1024.0}},
                "decode": {"8": {"pdserve_step_ms": 30.0}},
            }
        ]
    }
    (tmp_path / "engine.json").write_text(json.dumps(bench))
    prefill, decode = load_samples(tmp_path / "engine.json")
    assert prefill == StepSample((SeqWork(512, 0, True),), 0.5)
    assert len(decode.batch) == 8 and decode.step_s == 0.03


def test_bad_sample_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"batch": [], "step_s": 1}\n')
    with pytest.raises(SimConfigError, match=r"bad\.jsonl"):
        load_samples(path)
    with pytest.raises(SimConfigError, match="at least 3"):
        fit_efficiency(CostModel(SMOL, CPU), [])


def test_efficiency_saves_and_loads(tmp_path):
    path = tmp_path / "cal.json"
    TRUTH.save(path, hardware="cpu-local")
    assert Efficiency.load(path) == TRUTH


def test_disturbed_steps_are_set_aside():
    truth = CostModel(SMOL, CPU, efficiency=TRUTH)
    samples = [StepSample(b, truth.step_time(b)) for b in _batches()]
    # Two steps slowed 8× by another process on the core.
    samples[3] = StepSample(samples[3].batch, samples[3].step_s * 8)
    samples[9] = StepSample(samples[9].batch, samples[9].step_s * 8)
    fit = fit_efficiency(CostModel(SMOL, CPU), samples)
    assert fit.num_outliers == 2
    assert fit.mean_abs_rel_error < 0.02
    assert fit.efficiency.linear_compute == pytest.approx(0.21, rel=0.1)


def test_served_steps_keep_their_disturbances_in_the_jitter():
    """Logged by the runs to re-predict, a slowed step is part of what was measured."""
    truth = CostModel(SMOL, CPU, efficiency=TRUTH)
    samples = [StepSample(b, truth.step_time(b)) for b in _batches() * 2]
    samples[3] = StepSample(samples[3].batch, samples[3].step_s * 8)
    calibration_run = fit_efficiency(CostModel(SMOL, CPU), samples).efficiency
    served = fit_efficiency(CostModel(SMOL, CPU), samples, is_served=True).efficiency
    assert calibration_run.step_jitter[-1] == pytest.approx(1.0, abs=0.05)
    assert served.step_jitter[-1] == pytest.approx(8.0, rel=0.1)


@pytest.mark.parametrize(("shrink", "decay"), [(0.0, 0.0), (0.5, 0.5)])
def test_jitter_decay_is_how_the_spread_shrinks_with_step_length(shrink, decay):
    rng = np.random.default_rng(0)
    step_s = np.repeat([0.03, 0.06, 0.12, 0.24, 0.48], 400)
    ratios = 1 + rng.normal(0, 0.2, step_s.size) * (0.03 / step_s) ** shrink
    assert calibration._jitter_decay(ratios, step_s) == pytest.approx(decay, abs=0.08)


def test_jitter_records_the_spread_of_measured_around_modelled_steps():
    truth = CostModel(SMOL, CPU, efficiency=TRUTH)
    batches = _batches() * 3
    noisy = [
        StepSample(b, truth.step_time(b) * (1.0, 0.9, 1.1)[i % 3]) for i, b in enumerate(batches)
    ]
    jitter = fit_efficiency(CostModel(SMOL, CPU), noisy).efficiency.step_jitter
    assert len(jitter) == 101
    assert jitter[0] == pytest.approx(0.9, abs=0.03) and jitter[-1] == pytest.approx(1.1, abs=0.03)
    assert jitter[50] == pytest.approx(1.0, abs=0.03)
    exact = [StepSample(b, truth.step_time(b)) for b in batches]
    exact_jitter = fit_efficiency(CostModel(SMOL, CPU), exact).efficiency.step_jitter
    assert exact_jitter == pytest.approx((1.0,) * 101, abs=0.002)
