"""Frozen, validated configs for the scheduling core (vLLM's public names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SchedulingPolicy(enum.Enum):
    # A waiting prompt is prefilled whole in one step, before decodes: the classic
    # continuous batching whose long prefills stall every running stream.
    COLOCATED = "colocated"
    # Each step has a token budget; decodes first, prompt chunks fill the rest.
    CHUNKED = "chunked"


@dataclass(frozen=True)
class SchedulerConfig:
    scheduling: SchedulingPolicy = SchedulingPolicy.CHUNKED
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    # Cap on one request's chunk in a step (None: no cap beyond the budget).
    long_prefill_token_threshold: int | None = None
    # How many requests may be part-way through their prefill at once.
    max_num_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.scheduling, str):
            object.__setattr__(self, "scheduling", SchedulingPolicy(self.scheduling))
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_partial_prefills", self.max_num_partial_prefills)
        if self.long_prefill_token_threshold is not None:
            _positive("long_prefill_token_threshold", self.long_prefill_token_threshold)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
