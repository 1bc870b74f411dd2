"""Measure real engine steps on this machine, for calibration (imports the engine: torch).

Runs a fixed set of scenarios through `LLMEngine` — whole prompts, a long prompt in chunks,
decode batches at several contexts, decodes mixed with a prompt chunk — and records every
step's batch composition and wall time (`step()` end to end: schedule, forward, update).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from pdserve.core.sampling_params import SamplingParams
from pdserve.sim.calibration import StepSample
from pdserve.sim.cost_model import SeqWork

# (name, token budget, [(prompt tokens, output tokens) × requests]) run one after another.
SCENARIOS: tuple[tuple[str, int, list[tuple[int, int]]], ...] = (
    # Kernels compile and caches fill on first use: a bit of every kind of step, unrecorded.
    ("warm-up", 256, [(64, 6)] * 4 + [(600, 2)]),
    ("whole prompts", 2048, [(n, 2) for n in (32, 128, 512, 1024, 2048)]),
    ("long prompt in chunks", 512, [(3000, 2)]),
    ("decode batch 1", 2048, [(256, 16)]),
    ("decode batch 4", 2048, [(256, 16)] * 4),
    ("decode batch 16", 2048, [(128, 12)] * 16),
    ("decode batch 32", 2048, [(64, 12)] * 32),
    ("decode, long context", 2048, [(1500, 12)] * 4),
    ("decodes + chunk", 256, [(64, 40)] * 8 + [(1500, 2)]),
)
_WARM_UP = "warm-up"


def measure_step_samples(
    *,
    num_threads: int | None = None,
    model: str | None = None,
    dtype: str = "auto",
    progress: Callable[[str], None] = print,
) -> list[StepSample]:
    """Run the scenarios on the real engine; return one sample per step (warm-up dropped)."""
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(
        model=model,
        dtype=dtype,
        device="cpu",
        mode="chunked",
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        enable_prefix_caching=False,
        num_threads=num_threads,
    )
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    samples: list[StepSample] = []
    for name, budget, requests in SCENARIOS:
        engine.scheduler.config = dataclasses.replace(
            engine.scheduler.config, max_num_batched_tokens=budget
        )
        for i, (prompt_len, output_len) in enumerate(requests):
            ids = [rng.randrange(1000, vocab) for _ in range(prompt_len)]
            engine.add_request(
                f"{name}-{i}", ids, SamplingParams(max_tokens=output_len, ignore_eos=True)
            )
        steps = _run_timed(engine)
        if name != _WARM_UP:
            samples += steps
            progress(f"{name}: {len(steps)} steps")
    return samples


def _run_timed(engine) -> list[StepSample]:
    """Step the engine until idle, recording each step's composition and wall time."""
    samples: list[StepSample] = []

    def record(step) -> None:
        samples.append(StepSample(tuple(SeqWork(*seq) for seq in step.batch), step.step_s))

    engine.step_observers.append(record)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.step_observers.remove(record)
    return samples
