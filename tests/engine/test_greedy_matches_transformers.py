"""Correctness proof: pdserve's greedy tokens equal Hugging Face transformers' on the same
weights (the default GGUF dequantized to float32 and exported as a Hugging Face folder)."""

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NUM_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, loaded_fp32):
    transformers = pytest.importorskip("transformers")
    from pdserve.model.export_hf import export_hf

    folder = tmp_path_factory.mktemp("smollm2-hf")
    export_hf(loaded_fp32.path, folder, dtype="float32")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)


def test_greedy_tokens_equal_transformers(hf_model, make_llm, chat_token_ids):
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, temperature=0)
    ours = make_llm().generate(chat_token_ids, params, use_tqdm=False)
    for prompt, result in zip(chat_token_ids, ours, strict=True):
        with torch.inference_mode():
            generated = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
            )
        assert result.token_ids == generated[0, len(prompt) :].tolist()
