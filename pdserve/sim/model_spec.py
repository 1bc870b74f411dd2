"""Model architecture catalog: the shapes the cost model needs, for Llama-family models.

Each entry repeats the published Hugging Face `config.json` of that checkpoint (the hub repo
is named per entry); `load_model_spec` also reads any local `config.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.sim.errors import SimConfigError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer shapes (gated MLP, grouped-query attention)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise SimConfigError(
                    f"model {self.name}: {field_name} must be a positive integer, got {value!r}"
                )
        if self.num_attention_heads % self.num_kv_heads:
            raise SimConfigError(
                f"model {self.name}: num_attention_heads must be a multiple of num_key_value_heads"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of one layer's matmuls: q, k, v, o projections and gate, up, down."""
        attention = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attention + mlp

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All weights: embedding, layers (with their two RMSNorms), final norm, LM head."""
        layers = self.num_layers * (self.linear_params_per_layer + 2 * self.hidden_size)
        lm_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.lm_head_params + layers + self.hidden_size + lm_head

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV cache bytes one token occupies: layers × KV heads × head dim × (K and V) × size."""
        return self.num_layers * self.kv_size * 2 * dtype_bytes(kv_dtype)

    def weight_bytes(self, dtype: str = "bf16") -> int:
        return self.num_params * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise SimConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def spec_from_hf_config(config: dict, name: str) -> ModelSpec:
    """Build a `ModelSpec` from a Hugging Face `config.json` dict (Llama/Qwen2/Mistral)."""
    try:
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return ModelSpec(
            name=name,
            num_layers=config["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_attention_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
        )
    except KeyError as exc:
        raise SimConfigError(f"model config {name}: missing field {exc.args[0]!r}") from None


def _catalog_entry(name: str, **config) -> ModelSpec:
    return spec_from_hf_config(config, name)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # meta-llama/Llama-3.1-8B config.json
        _catalog_entry(
            "Llama-3.1-8B",
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
        ),
        # meta-llama/Meta-Llama-3-70B config.json (8k context; Llama-3.1-70B has the same
        # shapes with max_position_embeddings 131072).
        _catalog_entry(
            "Llama-3-70B",
            num_hidden_layers=80,
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
        ),
        _catalog_entry(
            "Llama-3.1-70B",
            num_hidden_layers=80,
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
        ),
        # Qwen/Qwen2.5-7B config.json
        _catalog_entry(
            "Qwen2.5-7B",
            num_hidden_layers=28,
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
        ),
        # Qwen/Qwen2.5-72B config.json
        _catalog_entry(
            "Qwen2.5-72B",
            num_hidden_layers=80,
            hidden_size=8192,
            intermediate_size=29568,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=152064,
            max_position_embeddings=131072,
        ),
        # mistralai/Mistral-7B-v0.3 config.json
        _catalog_entry(
            "Mistral-7B",
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=32768,
        ),
        # meta-llama/Llama-2-7b-hf config.json (multi-head attention: 32 KV heads); the
        # shape of TensorRT-LLM's published "LLaMA 7B" figures (docs/calibrations.md).
        _catalog_entry(
            "Llama-2-7B",
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=11008,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        # meta-llama/Llama-2-70b-hf config.json: Llama-3-70B's layers with a 32k vocabulary.
        _catalog_entry(
            "Llama-2-70B",
            num_hidden_layers=80,
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        # HuggingFaceTB/SmolLM2-135M-Instruct config.json
        _catalog_entry(
            "SmolLM2-135M",
            num_hidden_layers=30,
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    )
}


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A catalog model by name (case-insensitive), or a local HF `config.json` (or its folder)."""
    by_lower = {key.lower(): spec for key, spec in MODELS.items()}
    if name_or_path.lower() in by_lower:
        return by_lower[name_or_path.lower()]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SimConfigError(
            f"--model: {name_or_path!r} is neither a catalog model "
            f"({', '.join(sorted(MODELS))}) nor a config.json file"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SimConfigError(f"--model: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise SimConfigError(f"--model: {path} is not a JSON object")
    return spec_from_hf_config(config, str(path.parent.name or path))
