"""ModelConfig from config.json dicts and GGUF metadata, and its validation."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.model.config import ModelConfig, RopeScaling

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama_config_defaults_and_derived_sizes():
    config = ModelConfig.from_hf_config(LLAMA)
    assert config.head_dim == 32  # hidden_size / heads when head_dim is absent
    assert (config.q_size, config.kv_size) == (256, 64)
    assert config.eos_token_ids == (2, 3)
    assert not config.tie_word_embeddings and not config.attention_bias
    assert config.rope_scaling is None


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING},  # transformers 4.x
        {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}},  # transformers 5.x
        {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_SCALING, "type": "llama3"}},
    ],
)
def test_llama3_rope_scaling_in_both_spellings(rope):
    base = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    config = ModelConfig.from_hf_config(base | rope)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


def test_unsupported_rope_scaling_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf_config(LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen2_has_qkv_bias_and_switched_off_window_is_fine():
    config = ModelConfig.from_hf_config(
        LLAMA
        | {
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 1024,
            "use_sliding_window": False,
        }
    )
    assert config.attention_bias


def test_mistral_sliding_window():
    mistral = LLAMA | {"architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_hf_config(mistral | {"sliding_window": None})
    assert ModelConfig.from_hf_config(mistral | {"sliding_window": 4096})  # never active
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_hf_config(mistral | {"sliding_window": 1024})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"architectures": []}, "no 'architectures'"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
        ({"eos_token_id": 5000}, "outside the vocabulary"),
        ({"head_dim": 33}, "head_dim must be even"),
    ],
)
def test_invalid_configs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(LLAMA | change)


def test_config_is_frozen():
    config = ModelConfig.from_hf_config(LLAMA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 5  # type: ignore[misc]


def test_hf_config_round_trip():
    for source in (
        LLAMA,
        LLAMA | {"rope_scaling": LLAMA3_SCALING, "eos_token_id": 2, "tie_word_embeddings": True},
    ):
        config = ModelConfig.from_hf_config(source)
        assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_gguf_metadata(smollm_gguf):
    config = smollm_gguf.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    ) == (30, 9, 3, 64)
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings  # the file has no output.weight
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_gguf_metadata_unknown_architecture():
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        ModelConfig.from_gguf_metadata(
            {"general.architecture": "gpt2"}, has_output_weight=True, vocab_size=10
        )
