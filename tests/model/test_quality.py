"""Quantized weights keep the model's behaviour: teacher-forced on a fixed 2,048-token text,
the greedy token agrees with float32's at >= 97% of positions (int8) / >= 90% (4-bit GGUF
blocks), and perplexity stays within 2% / 8%."""

from __future__ import annotations

import pytest

from pdserve.model.loader import load_model
from pdserve.model.quality import reference_token_ids, teacher_force

pytestmark = pytest.mark.slow
THRESHOLDS = {"int8": (0.97, 0.02), "gguf": (0.90, 0.08)}  # (agreement, perplexity change)


@pytest.fixture(scope="module")
def float32_reference(smollm_fp32):
    ids = reference_token_ids(smollm_fp32)
    return ids, teacher_force(smollm_fp32, ids)


@pytest.mark.parametrize("quantization", list(THRESHOLDS))
def test_quantized_model_tracks_float32(float32_reference, quantization):
    ids, reference = float32_reference
    quantized = load_model(None, dtype="float32", device="cpu", quantization=quantization)
    scored = teacher_force(quantized, ids)
    min_agreement, max_ppl_change = THRESHOLDS[quantization]
    assert len(ids) >= 2000
    assert scored.top1_agreement(reference) >= min_agreement
    assert abs(scored.perplexity / reference.perplexity - 1) <= max_ppl_change
