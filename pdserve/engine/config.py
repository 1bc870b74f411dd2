"""The engine's frozen configuration: one tree for everything a `pdserve` engine starts with.

    EngineConfig: model, dtype, quantization, kv_cache_dtype, device, seed, num_threads,
                  kv_failure_policy, step_log
    ├── scheduler: core.config.SchedulerConfig   (max_num_batched_tokens, max_num_seqs, ...)
    ├── cache: core.config.CacheConfig           (block_size, num_blocks, ...)
    └── kv_transfer: KVTransferConfig | None     (disaggregated workers only)

Every default is its field's, defined once; `EngineConfig.from_kwargs` (the command line, the
offline `LLM(...)` and `LLMEngine.from_args`) builds the tree from flat keyword arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.model.config import KV_CACHE_DTYPES, Quantization

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_FAILURE_POLICIES = ("recompute", "fail")
QUANTIZATIONS = tuple(q.value for q in Quantization)
# Compute threads per engine process when num_threads is None (README "CPU speed").
DEFAULT_NUM_THREADS = 1
# Flat names that differ from their field's: the command line's `--mode` and `--num-kv-blocks`.
_ALIASES = {"mode": "scheduling", "num_kv_blocks": "num_blocks"}
_BRANCHES = {"scheduler": SchedulerConfig, "cache": CacheConfig}
# Which branch holds each of their fields (leaf names are unique across the tree).
_BRANCH_OF = {f.name: name for name, cls in _BRANCHES.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class EngineConfig:
    """Model and device settings, the scheduler's and the KV cache's.

    At load time the engine resolves `scheduler.max_model_len` to the smallest of the model's
    context, the user's `max_model_len` and what the KV cache holds, and `cache.num_blocks`
    (when None) from `cache.kv_cache_memory_gb`.
    """

    model: str | None = None
    dtype: str = "auto"
    # How linear weights are stored: none, int8 (computed at load) or gguf (the file's blocks).
    quantization: str = Quantization.NONE.value
    # The KV cache's dtype (auto: the model's); bfloat16 halves the bytes attention reads.
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Disaggregated serving: how this worker sends or receives KV (None: it does neither).
    kv_transfer: KVTransferConfig | None = None
    kv_failure_policy: str = "recompute"
    # Append every step's batch and wall time here as JSONL (see `engine.step_log`).
    step_log: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}"
                f", got {self.kv_cache_dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or self.num_threads < 1
        ):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(
                f"kv_failure_policy must be one of {', '.join(KV_FAILURE_POLICIES)}"
                f", got {self.kv_failure_policy!r}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The tree from flat keyword arguments named as the fields anywhere in it (vLLM's
        names: `max_num_batched_tokens`, `block_size`, ...; `mode` for the scheduling policy,
        `num_kv_blocks` for the cache's blocks). Fields not named keep their defaults."""
        branches: dict[str, dict[str, Any]] = {name: {} for name in _BRANCHES}
        top: dict[str, Any] = {}
        for name, value in kwargs.items():
            name = _ALIASES.get(name, name)
            branch = _BRANCH_OF.get(name)
            (branches[branch] if branch else top)[name] = value
        # An unknown name is left to EngineConfig's own TypeError.
        built = {name: _BRANCHES[name](**values) for name, values in branches.items()}
        return cls(**built, **top)
