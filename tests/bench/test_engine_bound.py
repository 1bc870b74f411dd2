"""benchmarks/engine.py's roofline bound of a decode step: its phases run one after the other,
so their bounds add, each the larger of its bytes over bandwidth and its FLOPs over the roof
its kernels take."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pdserve.model.config import ModelConfig

_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "engine.py"


@pytest.fixture(scope="module")
def engine_bench():
    spec = importlib.util.spec_from_file_location("engine_bench", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _limits(engine_bench, *, f32: float, bf16: float, int8: float, bandwidth: float):
    limits = engine_bench.Limits()
    limits.bandwidth = bandwidth
    limits.roofs = {torch.float32: f32, torch.bfloat16: bf16, torch.int8: int8}
    return limits


def _row(dtype: str, quantization: str, phases: dict, step_ms: float) -> dict:
    return {
        "dtype": dtype,
        "quantization": quantization,
        "kv_cache_dtype": "bfloat16",
        "prefill": {},
        "decode": {8: {"pdserve_step_ms": step_ms, "phases": phases}},
    }


def test_phases_count_every_weight_once_and_each_sequences_kv(engine_bench):
    config = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    one = engine_bench.decode_phases(config, 1000, 10, 1, 50.0)
    eight = engine_bench.decode_phases(config, 1000, 10, 8, 50.0)
    assert one["linears"]["bytes"] == eight["linears"]["bytes"] == 1000
    assert eight["attention"]["bytes"] == 8 * one["attention"]["bytes"] == 8 * 50 * 10
    assert eight["linears"]["flop"] == 8 * one["linears"]["flop"]
    assert eight["attention"]["flop"] == 8 * one["attention"]["flop"]


def test_bound_adds_each_phases_larger_limit(engine_bench):
    limits = _limits(engine_bench, f32=1e9, bf16=2e9, int8=4e9, bandwidth=1e9)
    # Linears: 1 ms of bytes, 4 ms of int8 compute. Attention: 3 ms of bytes, 1.5 ms of
    # compute (half at the bf16 roof, half at float32's).
    phases = {
        "linears": {"bytes": 1e6, "flop": 16e6},
        "attention": {"bytes": 3e6, "flop": 2e6},
    }
    row = _row("bfloat16", "gguf", phases, step_ms=14.0)
    limits.apply(row)
    d = row["decode"][8]
    assert d["floor_ms"] == pytest.approx(4.0)
    assert d["compute_ms"] == pytest.approx(5.5)
    # The larger of floor and compute for the whole step (5.5 ms) would be below what the
    # phases, one after the other, need: 4 + 3.
    assert d["bound_ms"] == pytest.approx(7.0)
    assert d["x_bound"] == pytest.approx(2.0)
    assert d["x_floor"] == pytest.approx(3.5)


def test_bfloat16_activations_take_the_better_float_roof(engine_bench):
    # A CPU without bf16 dot products: torch's bf16 GEMM runs below float32's, and the
    # kernels widen bf16 to float32 FMAs, so float32's roof bounds them.
    limits = _limits(engine_bench, f32=2e9, bf16=1e9, int8=4e9, bandwidth=1e12)
    phases = {"linears": {"bytes": 1, "flop": 4e6}, "attention": {"bytes": 1, "flop": 0}}
    row = _row("bfloat16", "none", phases, step_ms=4.0)
    limits.apply(row)
    assert row["decode"][8]["compute_ms"] == pytest.approx(2.0)
    assert row["roof_gflop_s"] == pytest.approx(2.0)


def test_working_set_floor_is_the_steps_bytes_at_its_own_streaming_rate(engine_bench):
    limits = _limits(engine_bench, f32=1e9, bf16=2e9, int8=4e9, bandwidth=1e9)
    phases = {"linears": {"bytes": 3e6, "flop": 0}, "attention": {"bytes": 1e6, "flop": 0}}
    row = _row("bfloat16", "none", phases, step_ms=5.0)
    # The working set streams at twice memory's rate (a cache holds it): its floor halves.
    row["decode"][8]["working_set_bandwidth"] = 2e9
    limits.apply(row)
    d = row["decode"][8]
    assert d["floor_ms"] == pytest.approx(4.0)
    assert d["working_set_floor_ms"] == pytest.approx(2.0)
    assert d["x_working_set_floor"] == pytest.approx(2.5)


@pytest.mark.parametrize("threads", [1, 2])
def test_bandwidth_of_a_buffer_of_about_the_bytes_asked_for(engine_bench, threads):
    # 1,000 bytes round up to whole shares of 64 floats per thread.
    assert engine_bench.measure_bandwidth(threads, repeats=2, nbytes=1000) > 0
