"""Reading a GGUF checkpoint: metadata -> `ModelConfig` and `Tokenizer`, tensors -> float32
weights (or the file's own quantized blocks) under their Hugging Face names and layout."""

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
from pdserve.model.quant import QuantizedWeight, QuantType
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

    def weights(
        self, keep_blocks: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(Hugging Face name, tensor in Hugging Face layout) for every tensor: float32, or
        with `keep_blocks` the file's own Q8_0 / Q4_0 / Q4_1 blocks as `QuantizedWeight`s."""
        for name, tensor in self._tensors.items():
            hf_name = _hf_name(name)
            if hf_name is None:
                logger.debug("%s: ignoring tensor %s", self.path, name)
                continue
            shape = tuple(reversed(tensor.shape.tolist()))  # ggml lists the fastest dim first
            qtype = QuantType.__members__.get(tensor.tensor_type.name)
            if keep_blocks and qtype is not None and qtype is not QuantType.INT8:
                blocks = QuantizedWeight(qtype, np.asarray(tensor.data), shape)
                yield hf_name, blocks.permute_rows(self._hf_row_order(hf_name, shape[0]))
                continue
            try:
                values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            except (ValueError, NotImplementedError) as e:
                raise ModelLoadError(
                    f"{self.path}: cannot dequantize {name} ({tensor.tensor_type.name}): {e}"
                ) from None
            values = values[self._hf_row_order(hf_name, shape[0])]
            # Unquantized tensors come back as read-only views of the memory-mapped file.
            yield (
                hf_name,
                torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])),
            )

    def _hf_row_order(self, hf_name: str, num_rows: int) -> np.ndarray | slice:
        # llama.cpp's converter reorders each Llama head's Q/K rows from "rotate half" halves
        # to interleaved pairs; undo it. Qwen2 files keep the Hugging Face order.
        if self.config.architecture == "LlamaForCausalLM":
            if hf_name.endswith("q_proj.weight"):
                return unpermute_rotary(np.arange(num_rows), self.config.num_attention_heads)
            if hf_name.endswith("k_proj.weight"):
                return unpermute_rotary(np.arange(num_rows), self.config.num_key_value_heads)
        return slice(None)


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
