"""SmolLM2-135M-Instruct (the default GGUF): pdserve against transformers on the same
weights, exported by pdserve to a float32 Hugging Face folder."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.attention import AttentionMetadata, allocate_kv_cache
from pdserve.model.loader import load_model
from tests.model.helpers import paged_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain step by step how photosynthesis works.",
]
NUM_NEW_TOKENS = 32


def _prompt_ids(loaded, text: str) -> list[int]:
    tokenizer = loaded.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    num_blocks = -(-len(ids) // 16)
    cache = allocate_kv_cache(loaded.config, num_blocks, 16, loaded.dtype, loaded.device)
    meta = AttentionMetadata.build([(list(range(num_blocks)), 0, len(ids))], 16, "cpu")
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, meta)
    return loaded.model.compute_logits(hidden)


def _hf_greedy(hf_model, ids: list[int], num_new_tokens: int) -> list[int]:
    """transformers' greedy generation (its own dense KV cache)."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("text", PROMPTS)
def test_prompt_logits_match_transformers(smollm_fp32, hf_smollm, text):
    ids = _prompt_ids(smollm_fp32, text)
    with torch.no_grad():
        expected = hf_smollm(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(smollm_fp32, ids), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("text", PROMPTS)
def test_paged_greedy_decode_matches_transformers(smollm_fp32, hf_smollm, text):
    ids = _prompt_ids(smollm_fp32, text)
    expected = _hf_greedy(hf_smollm, ids, NUM_NEW_TOKENS)
    assert paged_greedy(smollm_fp32.model, ids, NUM_NEW_TOKENS) == expected
    assert paged_greedy(smollm_fp32.model, ids, NUM_NEW_TOKENS, chunk_size=7) == expected
    assert smollm_fp32.config.eos_token_ids[0] not in expected  # a real continuation


def test_gguf_load_equals_exported_folder(smollm_fp32):
    from_gguf = load_model(None, dtype="float32", device="cpu")
    assert from_gguf.name == "SmolLM2-135M-Instruct"
    assert from_gguf.config == smollm_fp32.config
    ids = _prompt_ids(from_gguf, PROMPTS[0])
    assert ids == _prompt_ids(smollm_fp32, PROMPTS[0])
    torch.testing.assert_close(_prefill_logits(from_gguf, ids), _prefill_logits(smollm_fp32, ids))


@pytest.fixture(scope="module")
def smollm_bf16():
    return load_model(None, dtype="bfloat16", device="cpu")


def test_bfloat16_decode_steps_track_float32(smollm_bf16, smollm_fp32):
    """bfloat16 decode steps (the few-row kernels) against float32 logits of the same tokens."""
    ids = _prompt_ids(smollm_bf16, PROMPTS[0])
    num_steps = 8
    whole = _prefill_logits(smollm_fp32, ids)[-num_steps:]
    model, config = smollm_bf16.model, smollm_bf16.config
    num_blocks = -(-len(ids) // 16)
    cache = allocate_kv_cache(config, num_blocks, 16, smollm_bf16.dtype, "cpu")
    table = list(range(num_blocks))
    start = len(ids) - num_steps
    meta = AttentionMetadata.build([(table, 0, start)], 16, "cpu")
    model(torch.tensor(ids[:start]), torch.arange(start), cache, meta)
    steps = []
    for position in range(start, len(ids)):
        meta = AttentionMetadata.build([(table, position, 1)], 16, "cpu")
        hidden = model(
            torch.tensor(ids[position : position + 1]), torch.tensor([position]), cache, meta
        )
        steps.append(model.compute_logits(hidden))
    steps = torch.cat(steps)
    assert (steps.argmax(-1) == whole.argmax(-1)).all()
    assert (steps - whole).abs().max() < 0.04 * whole.abs().max()


def test_bfloat16_tracks_float32(smollm_fp32, smollm_bf16):
    bf16 = smollm_bf16
    ids = _prompt_ids(bf16, PROMPTS[1])
    logits16, logits32 = _prefill_logits(bf16, ids), _prefill_logits(smollm_fp32, ids)
    agreement = (logits16.argmax(-1) == logits32.argmax(-1)).float().mean()
    assert agreement > 0.9
    assert (logits16 - logits32).abs().max() < 0.1 * logits32.abs().max()
