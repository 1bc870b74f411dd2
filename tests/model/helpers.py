"""Reusable helpers for model tests: tiny random checkpoints and a paged greedy decoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.model.attention import AttentionMetadata, allocate_kv_cache
from pdserve.model.config import ModelConfig, Quantization
from pdserve.model.cpu_runtime import read_cpu_flags
from pdserve.model.kernels.build import VARIANTS, can_run, find_compiler
from pdserve.model.llama import LlamaForCausalLM

TINY_VOCAB_SIZE = 260  # 256 byte tokens + 4 specials


def tiny_hf_model(
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
):
    """A random-weight transformers model (eager attention, float32) of a tiny config with
    GQA (4 query heads on 2 KV heads)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kwargs = {"rope_scaling": rope_scaling, "rope_theta": 500000.0} if rope_scaling else {}
    config = config_cls(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.1,
        bos_token_id=256,
        eos_token_id=257,
        attn_implementation="eager",
        **kwargs,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random norm weights, so a mix-up of norms cannot go unnoticed
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def kernel_variants() -> list:
    """Every CPU kernel variant as a pytest param, skipped (with the flags it lacks) where this
    CPU cannot run it: a machine tests each variant it can execute."""
    return [
        pytest.param(
            v.name,
            marks=pytest.mark.skipif(
                not can_run(v),
                reason=f"this CPU lacks {', '.join(sorted(v.cpu_flags - read_cpu_flags()))}",
            ),
        )
        for v in VARIANTS
    ]


def model_config_of(hf_model) -> ModelConfig:
    return ModelConfig.from_hf_config(
        {**hf_model.config.to_dict(), "architectures": [type(hf_model).__name__]}
    )


def pdserve_from_hf(
    hf_model,
    dtype: torch.dtype = torch.float32,
    use_cpu_kernels: bool = True,
    cpu_isa: str | None = None,
    quantization: Quantization = Quantization.NONE,
) -> LlamaForCausalLM:
    """pdserve's model holding the same weights, with CPU linears packed."""
    model = LlamaForCausalLM(
        model_config_of(hf_model),
        dtype,
        "cpu",
        use_cpu_kernels=use_cpu_kernels,
        cpu_isa=cpu_isa,
        quantization=quantization,
    )
    model.load_weights(hf_model.state_dict())
    model.pack()
    return model


def paged_greedy(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    chunk_size: int | None = None,
    block_size: int = 16,
) -> list[int]:
    """Greedy tokens generated one decode step at a time through a paged KV cache whose
    blocks are deliberately out of order; the prompt is prefilled in chunks of `chunk_size`."""
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // block_size)
    cache = allocate_kv_cache(model.config, 2 * num_blocks + 1, block_size, model.dtype, "cpu")
    block_table = list(range(2 * num_blocks, 0, -2))  # reversed, every other block
    tokens = list(prompt_ids)
    num_computed = 0
    chunk_size = chunk_size or len(prompt_ids)
    while len(tokens) < total:
        num_new = min(chunk_size, len(tokens) - num_computed)
        meta = AttentionMetadata.build([(block_table, num_computed, num_new)], block_size, "cpu")
        hidden = model(
            torch.tensor(tokens[num_computed : num_computed + num_new]),
            torch.arange(num_computed, num_computed + num_new),
            cache,
            meta,
        )
        num_computed += num_new
        if num_computed == len(tokens):
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return tokens[len(prompt_ids) :]


def write_tiny_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer matching TINY_VOCAB_SIZE: 256 byte tokens, then <s>, </s>,
    <|user|>, <|assistant|>, with a chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<s>", "</s>", "<|user|>", "<|assistant|>")
        ]
    )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
        "{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}
        )
    )


def require_kernels(ops, isa: str = "CPU"):
    """`ops` (the loaded kernels, or None where they did not build): a skip only where this
    machine has no C compiler; a build that fails beside one is a failure of the kernels."""
    if ops is not None:
        return ops
    if find_compiler() is None:
        pytest.skip(f"no C compiler to build the {isa} kernels")
    pytest.fail(f"the {isa} kernels did not compile (the build's error is in the log above)")
