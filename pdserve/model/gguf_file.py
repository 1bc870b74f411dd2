"""Reading a GGUF checkpoint: metadata -> `ModelConfig` and `Tokenizer`, tensors -> dequantized
float32 weights under their Hugging Face names and layout."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from pdserve.model.config import ModelConfig, ModelLoadError
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFModelFile:
    """One .gguf file. Raises `ModelLoadError` naming the file if it cannot be used."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(self.path)
            self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        except FileNotFoundError:
            raise ModelLoadError(f"{self.path}: no such file") from None
        except (ValueError, KeyError, IndexError, OSError) as e:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({e})") from None
        self._tensors = {t.name: t for t in reader.tensors}
        if "rope_freqs.weight" in self._tensors:
            raise ModelLoadError(
                f"{self.path}: rope frequency factors (Llama 3.1 rope scaling "
                "in GGUF) are not supported; load the Hugging Face folder"
            )
        try:
            self.config = ModelConfig.from_gguf_metadata(
                self.metadata,
                has_output_weight="output.weight" in self._tensors,
                vocab_size=len(self.metadata.get("tokenizer.ggml.tokens", ())),
            )
        except ValueError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def source_of(self, name: str) -> Path:
        """The file a (Hugging Face-named) tensor comes from."""
        return self.path

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_metadata(self.metadata, self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor in Hugging Face layout) for every tensor."""
        for name, tensor in self._tensors.items():
            hf_name = _hf_name(name)
            if hf_name is None:
                logger.debug("%s: ignoring tensor %s", self.path, name)
                continue
            shape = tuple(reversed(tensor.shape.tolist()))  # ggml lists the fastest dim first
            try:
                values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            except (ValueError, NotImplementedError) as e:
                raise ModelLoadError(
                    f"{self.path}: cannot dequantize {name} ({tensor.tensor_type.name}): {e}"
                ) from None
            yield hf_name, torch.from_numpy(self._to_hf_layout(hf_name, values))

    def _to_hf_layout(self, hf_name: str, values: np.ndarray) -> np.ndarray:
        # llama.cpp's converter reorders each Llama head's Q/K rows from "rotate half" halves
        # to interleaved pairs; undo it. Qwen2 files keep the Hugging Face order.
        if self.config.architecture == "LlamaForCausalLM":
            if hf_name.endswith("q_proj.weight"):
                values = unpermute_rotary(values, self.config.num_attention_heads)
            elif hf_name.endswith("k_proj.weight"):
                values = unpermute_rotary(values, self.config.num_key_value_heads)
        # Unquantized tensors come back as read-only views of the memory-mapped file.
        return np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of each head from interleaved (x0, y0, x1, y1, ...) to halves (x..., y...)."""
    head_dim = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
