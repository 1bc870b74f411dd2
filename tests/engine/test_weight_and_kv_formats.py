"""Engine options for fewer bytes per token: --kv-cache-dtype and --quantization."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def test_bfloat16_kv_cache_under_a_float32_model(loaded_fp32, chat_token_ids):
    config = EngineConfig.from_kwargs(
        dtype="float32", device="cpu", kv_cache_dtype="bfloat16", num_kv_blocks=64
    )
    engine = LLMEngine(config, loaded=loaded_fp32)
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    assert engine.kv_layout().dtype == "bfloat16"  # what a KV transfer's other end must match
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    narrow = LLM(engine=engine).generate(chat_token_ids[:2], params, use_tqdm=False)
    wide = LLM(
        engine=LLMEngine(EngineConfig.from_kwargs(dtype="float32", device="cpu"), loaded_fp32)
    ).generate(chat_token_ids[:2], params, use_tqdm=False)
    # Rounding K/V to bf16 moves logits slightly: the first greedy tokens still agree.
    for a, b in zip(narrow, wide, strict=True):
        assert a.token_ids[:3] == b.token_ids[:3]


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_quantized_engine_generates(quantization, chat_token_ids):
    engine = LLMEngine.from_args(
        dtype="float32", device="cpu", quantization=quantization, num_kv_blocks=64
    )
    assert engine.loaded.quantization.value == quantization
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    [out] = LLM(engine=engine).generate(chat_token_ids[:1], params, use_tqdm=False)
    assert len(out.token_ids) == 6


def test_unknown_quantization_names_the_field():
    with pytest.raises(ValueError, match="quantization must be one of none, int8, gguf"):
        EngineConfig.from_kwargs(quantization="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")
