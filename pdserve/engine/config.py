"""The engine's frozen configuration (everything a `pdserve` process is started with)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.config import SchedulerConfig
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.model.config import KV_CACHE_DTYPES, Quantization

DEFAULT_KV_CACHE_MEMORY_GB = 1.0
# Compute threads per engine process when num_threads is None (README "CPU speed").
DEFAULT_NUM_THREADS = 1
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class EngineConfig:
    """Model, device and KV-cache settings plus the scheduler's.

    `scheduler.max_model_len` is resolved at load time to the smallest of the model's context,
    the user's `max_model_len` and what the KV cache holds. KV capacity comes from
    `num_kv_blocks`, else from `kv_cache_memory_gb` (default 1 GB).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # How linear weights are stored: none, int8 (computed at load) or gguf (the file's blocks).
    quantization: str = Quantization.NONE.value
    # The KV cache's dtype (auto: the model's); bfloat16 halves the bytes attention reads.
    kv_cache_dtype: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    # Disaggregated serving: how this worker sends or receives KV (None: it does neither).
    kv_transfer: KVTransferConfig | None = None
    kv_failure_policy: str = "recompute"
    # Append every step's batch and wall time here as JSONL (see `engine.step_log`).
    step_log: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in {q.value for q in Quantization}:
            names = ", ".join(q.value for q in Quantization)
            raise ValueError(f"quantization must be one of {names}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}"
                f", got {self.kv_cache_dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        for name in ("block_size", "num_kv_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(
                f"kv_failure_policy must be one of {', '.join(KV_FAILURE_POLICIES)}"
                f", got {self.kv_failure_policy!r}"
            )
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
