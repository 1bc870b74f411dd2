"""Frozen, validated configs for the scheduling core (vLLM's public names).

Their fields' defaults are pdserve's defaults: the engine's and the simulator's command lines
take theirs from here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The per-step token budget of chunked prefill when none is given: a burst of short prompts
# goes in one or two steps (stalling few of the running streams' token gaps; at 512, 32
# prompts arriving together stalled them over ~6 steps and the burst's ITL p99 was 9x its p50).
DEFAULT_CHUNKED_BUDGET = 2048
# One prompt's chunk in a step when none is given, while other requests share the engine: a
# long prompt stalls the running streams for at most this many tokens per step
# (`max_num_partial_prefills` bounds how many long prompts are part-way at once); short
# prompts fill the rest of the budget whole. A prompt alone takes the whole budget.
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 512
# An idle engine handed a request keeps taking more while they arrive less than this far
# apart, at most MAX_BURST_GAPS gaps in all or until they fill a step, so that a burst's
# prompts share one prefill step (the server's `--burst-gap`; `AsyncLLMEngine._gather_burst`,
# and the simulator's workers). Measured through the server (Zen 5, 2 CPUs): a burst's
# requests reach the engine ~1 ms apart, but those on new connections come 5-15 ms after
# those on kept-alive ones.
DEFAULT_BURST_GAP_S = 0.02
MAX_BURST_GAPS = 5


class SchedulingPolicy(enum.Enum):
    # A waiting prompt is prefilled whole in one step, before decodes: the classic
    # continuous batching whose long prefills stall every running stream.
    COLOCATED = "colocated"
    # Each step has a token budget; decodes first, prompt chunks fill the rest.
    CHUNKED = "chunked"


class Mode(enum.Enum):
    """How a deployment shares machines between prefill and decode (`--mode`): the serving
    modes of `serve`, `simulate` and `bench compare`, named here once."""

    COLOCATED = "colocated"
    CHUNKED = "chunked"
    # Prefill and decode workers behind a router; each worker chunks its prompts.
    DISAGG = "disagg"

    @property
    def scheduling(self) -> SchedulingPolicy:
        """What each engine of this mode schedules by."""
        return SchedulingPolicy.COLOCATED if self is Mode.COLOCATED else SchedulingPolicy.CHUNKED


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_num_batched_tokens` None takes the policy's budget: `DEFAULT_CHUNKED_BUDGET` when
    chunked; `max_model_len` when colocated (prompts are taken whole, so the budget only bounds
    how many share a step). `max_model_len` None is the model's context length: the engine
    sets it when it loads the model (then a colocated budget follows it); a `Scheduler` needs
    both set."""

    scheduling: SchedulingPolicy = SchedulingPolicy.CHUNKED
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    # Cap on one request's chunk in a step while others run or wait (None: no cap beyond the
    # budget).
    long_prefill_token_threshold: int | None = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
    # How many requests may be part-way through their prefill at once.
    max_num_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.scheduling, str):
            object.__setattr__(self, "scheduling", SchedulingPolicy(self.scheduling))
        if self.max_num_batched_tokens is None:
            budget = (
                DEFAULT_CHUNKED_BUDGET
                if self.scheduling is SchedulingPolicy.CHUNKED
                else self.max_model_len
            )
            object.__setattr__(self, "max_num_batched_tokens", budget)
        for name in ("max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_partial_prefills", self.max_num_partial_prefills)

    def is_step_full(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether `num_seqs` prompts of `num_tokens` in all fill a step (its seats or its
        token budget): a burst gathered that far has nothing to wait for."""
        return num_seqs >= self.max_num_seqs or num_tokens >= self.max_num_batched_tokens

    @property
    def max_chunk_tokens(self) -> int | None:
        """The most new tokens one prefill chunk can have (with `max_model_len` set): a
        whole prompt when colocated, else the budget (a prompt alone is not capped by the
        long-prefill threshold)."""
        if self.scheduling is SchedulingPolicy.COLOCATED:
            return self.max_model_len
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` tokens. `num_blocks` None sizes
    it to `kv_cache_memory_gb` when the engine knows the model's bytes per token."""

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 1.0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if not (isinstance(self.kv_cache_memory_gb, int | float) and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
