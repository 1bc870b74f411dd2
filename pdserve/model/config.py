"""`ModelConfig`: the architecture hyper-parameters of a Llama-family model.

Built from a Hugging Face `config.json` dict or from GGUF metadata; validated on construction.
Every supported architecture runs through the same forward pass: they differ only in QKV bias
(Qwen2), rope scaling (Llama 3.1+) and tied embeddings.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """The one error model loading raises: the message names the file and the problem.

    Front ends print it as is, without a traceback.
    """


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; `ModelLoadError` naming the file if unreadable or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


class Quantization(enum.Enum):
    """`--quantization`: how linear weights are stored (see `model/quant.py`)."""

    NONE = "none"  # the model dtype
    INT8 = "int8"  # int8 computed at load from any checkpoint (weight-only)
    GGUF = "gguf"  # a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks


# `--kv-cache-dtype`: auto is the model dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")

# Hugging Face `architectures[0]` values we run, and whether their attention has a QKV bias
# unless config.json says otherwise.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
# GGUF `general.architecture` -> Hugging Face architecture.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's "llama3" rope scaling: low frequencies are slowed down by `factor`,
    high ones kept, and the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _positive_float("rope_scaling.factor", self.factor)
        _positive_float("rope_scaling.low_freq_factor", self.low_freq_factor)
        _positive_float("rope_scaling.high_freq_factor", self.high_freq_factor)
        _positive_int(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. Construct with keywords or via
    `from_hf_config` / `from_gguf_metadata`; invalid values raise `ValueError`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    # Qwen2 has a bias on the Q, K and V projections.
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _positive_int(name, getattr(self, name))
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for token_id in (self.bos_token_id, *self.eos_token_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"special token id {token_id} is outside the vocabulary "
                    f"(vocab_size {self.vocab_size})"
                )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict (transformers 4.x or 5.x spelling)."""
        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry")
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _reject_sliding_window(config)
        num_heads = _required(config, "num_attention_heads")
        hidden_size = _required(config, "hidden_size")
        rope_theta, rope_scaling = _hf_rope(config)
        return cls(
            architecture=architecture,
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(config, "intermediate_size"),
            num_hidden_layers=_required(config, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or _divide(hidden_size, num_heads, "hidden_size"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(
                config.get("attention_bias", SUPPORTED_ARCHITECTURES[architecture])
            ),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_ids(config.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], *, has_output_weight: bool, vocab_size: int
    ) -> ModelConfig:
        """From decoded GGUF key/values. Tied embeddings iff the file has no `output.weight`."""
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        if metadata.get(f"{arch}.rope.scaling.type", "none") != "none":
            raise ValueError(
                f"unsupported GGUF rope scaling {metadata[f'{arch}.rope.scaling.type']!r}"
            )
        num_heads = _required(metadata, f"{arch}.attention.head_count")
        hidden_size = _required(metadata, f"{arch}.embedding_length")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        eot = metadata.get("tokenizer.ggml.eot_token_id")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=metadata.get(f"{arch}.vocab_size", vocab_size),
            hidden_size=hidden_size,
            intermediate_size=_required(metadata, f"{arch}.feed_forward_length"),
            num_hidden_layers=_required(metadata, f"{arch}.block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=metadata.get(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=metadata.get(f"{arch}.attention.key_length")
            or metadata.get(f"{arch}.rope.dimension_count")
            or _divide(hidden_size, num_heads, "embedding_length"),
            rms_norm_eps=_required(metadata, f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=metadata.get(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=_required(metadata, f"{arch}.context_length"),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict transformers (4.x and 5.x) and vLLM read for this model."""
        model_type = {
            "LlamaForCausalLM": "llama",
            "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2",
        }[self.architecture]
        rope_scaling = None
        if self.rope_scaling is not None:
            rope_scaling = {"rope_type": "llama3", **self.rope_scaling.__dict__}
        eos = list(self.eos_token_ids)
        return {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "use_cache": True,
        }


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 nests theta and scaling in `rope_parameters`; 4.x has them at top level.
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"rope_scaling of type llama3 lacks {e.args[0]!r}") from None


def _reject_sliding_window(config: Mapping[str, Any]) -> None:
    # Mistral v0.1 attends within a 4096-token window; we only implement full attention, which
    # differs once a sequence outgrows the window. Qwen2 sets the window but switches it off.
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window", True) is False:
        return
    max_len = config.get("max_position_embeddings", 2048)
    if window < max_len:
        raise ValueError(
            f"sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_len}) is not supported"
        )


def _required(mapping: Mapping[str, Any], key: str) -> Any:
    if mapping.get(key) is None:
        raise ValueError(f"missing required field {key!r}")
    return mapping[key]


def _divide(numerator: int, denominator: int, name: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{name} ({numerator}) is not a multiple of the head count "
            f"({denominator}); set head_dim explicitly"
        )
    return numerator // denominator


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
