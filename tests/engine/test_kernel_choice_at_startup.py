"""The measured choice between the paged prefill kernel and SDPA is made before serving: an
engine started on a machine with no cached timings measures the cases its limits allow at
startup, so a long prompt's chunks never wait for a measurement; a case left unmeasured (a
spent startup budget) runs SDPA, and is not measured while serving either: a multi-second
case measured while idle would delay the next request."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine import llm_engine
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.attention import prefill_kernel_choice
from pdserve.model.kernels import choice as kernel_choice
from tests.model.helpers import require_kernels

pytestmark = pytest.mark.slow

# Limits that keep the startup grid small: chunks of <= 128 tokens in <= 2,048-token sequences.
LIMITS = dict(num_kv_blocks=128, max_num_batched_tokens=128)
PROMPT_LEN = 1500  # twelve chunks, the later ones over a context of 1,000 tokens and more
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
IDLE_S = 2.0  # idle turns enough to measure a case, had one been queued


@pytest.fixture
def cold_choice(loaded_fp32, tmp_path, monkeypatch):
    """The kernels' choice as on a machine that never measured it (an empty cache dir)."""
    ops = require_kernels(loaded_fp32.model.cpu_ops)
    monkeypatch.setattr(kernel_choice, "cache_dir", lambda: tmp_path)
    prefill_kernel_choice.cache_clear()
    yield lambda: prefill_kernel_choice(ops)
    prefill_kernel_choice.cache_clear()


def _spy_on_measuring(choice) -> list[tuple]:
    measured = []
    prepare = choice._prepare

    def spy(case):
        measured.append(case)
        return prepare(case)

    choice._prepare = spy
    return measured


def _long_prompt(loaded) -> list[int]:
    words = loaded.tokenizer.encode(" the quick brown fox jumps over a lazy dog")
    return (words * PROMPT_LEN)[:PROMPT_LEN]


def test_first_long_prompt_on_a_cold_machine_never_waits_for_a_measurement(
    loaded_fp32, cold_choice
):
    engine = LLMEngine(
        EngineConfig.from_kwargs(dtype="float32", device="cpu", **LIMITS), loaded=loaded_fp32
    )
    choice = cold_choice()
    assert choice.timings and not choice.pending  # measured at startup, all of it
    assert list(choice._path.parent.glob("prefill-attention-*.json"))
    measured_while_serving = _spy_on_measuring(choice)
    [result] = LLM(engine=engine).generate(_long_prompt(loaded_fp32), GREEDY, use_tqdm=False)
    assert len(result.token_ids) == GREEDY.max_tokens
    assert measured_while_serving == []
    assert choice.num_defaulted == 0  # every chunk's case had a measured answer


def test_a_case_past_the_startup_budget_runs_sdpa_and_costs_no_idle_time(
    loaded_fp32, cold_choice, monkeypatch
):
    monkeypatch.setattr(llm_engine, "KERNEL_CHOICE_BUDGET_S", 0.0)  # nothing fits at startup
    engine = LLMEngine(
        EngineConfig.from_kwargs(dtype="float32", device="cpu", **LIMITS), loaded=loaded_fp32
    )
    choice = cold_choice()
    assert not choice.timings and choice.skipped and not choice.pending
    ops, calls = loaded_fp32.model.cpu_ops, []
    kernel = ops.paged_prefill
    measured_while_serving = _spy_on_measuring(choice)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "paged_prefill", lambda *args: calls.append(args) or kernel(*args))
        LLM(engine=engine).generate(_long_prompt(loaded_fp32), GREEDY, use_tqdm=False)
    assert measured_while_serving == [] and calls == []  # SDPA ran every chunk
    assert choice.num_defaulted > 0

    async def main():  # the engine thread, idle: nothing is submitted, nothing measured
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        try:
            await asyncio.sleep(IDLE_S)
        finally:
            await async_engine.shutdown()

    asyncio.run(main())
    assert measured_while_serving == [] and not choice.pending
