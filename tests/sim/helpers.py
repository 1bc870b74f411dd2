"""Small deployments and workloads for simulator tests."""

from __future__ import annotations

from pdserve.core.config import Mode
from pdserve.sim.config import PoolConfig, SimConfig, scheduler_config_for
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS
from pdserve.sim.workload import SimRequestSpec

MODEL = MODELS["Llama-3.1-8B"]
H100 = get_hardware("H100-SXM")


def make_config(
    mode: Mode = Mode.CHUNKED,
    *,
    num_workers: int = 1,
    tp: int = 1,
    num_prefill: int = 1,
    budget: int = 512,
    max_num_seqs: int = 64,
    model=MODEL,
    **kwargs,
) -> SimConfig:
    sched = scheduler_config_for(mode, budget, max_num_seqs, 8192)
    prefill = PoolConfig(num_prefill, tp, sched) if mode is Mode.DISAGG else None
    return SimConfig(model, H100, mode, PoolConfig(num_workers, tp, sched), prefill, **kwargs)


def azure_trace(num_prompts: int, request_rate: float | None) -> list[SimRequestSpec]:
    """The first requests of the Azure conversation trace, through the bench's workload."""
    import pytest

    from pdserve.sim.workload import plan_requests
    from pdserve.workload import (
        TraceWindow,
        WorkloadOptions,
        default_trace_path,
        make_workload,
    )

    if not default_trace_path().is_file():
        pytest.skip(f"the packaged Azure trace {default_trace_path()} is missing")

    options = WorkloadOptions(trace_window=TraceWindow(num_prompts=num_prompts))
    return plan_requests(
        make_workload("trace", options, None), seed=0, request_rate=request_rate, max_model_len=8192
    )


def poisson_specs(
    num: int, rate: float, seed: int = 0, prompt=(64, 2048), output=(16, 128)
) -> list[SimRequestSpec]:
    import random

    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(num):
        t += rng.expovariate(rate)
        specs.append(SimRequestSpec(str(i), t, rng.randint(*prompt), rng.randint(*output)))
    return specs


def streams_plus_long_prompt(
    num_streams: int = 4, long_len: int = 6000, at: float = 0.5
) -> list[SimRequestSpec]:
    """Short streams decoding for a while, and one long prompt arriving among them."""
    specs = [SimRequestSpec(f"s{i}", 0.0, 32, 400) for i in range(num_streams)]
    return [*specs, SimRequestSpec("long", at, long_len, 8)]
