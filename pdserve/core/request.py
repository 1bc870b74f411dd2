"""A request's state as the scheduler sees it.

The single invariant: `num_computed_tokens` catches up to `num_tokens`. There are no
phases: a prompt still being prefilled and a sequence in decode differ only in how far
behind `num_computed_tokens` is.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away, shutdown, or a failed KV transfer
    ERROR = "error"


@dataclass
class RequestMetrics:
    """Clock readings (time.monotonic seconds) along one request's life: the one record of
    them, kept on the `Request` and handed out with every output. The scheduler sets
    `first_scheduled_time`, the engine the rest."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Seconds spent in steps that computed this request's prompt.
    prefill_time: float = 0.0


@dataclass(eq=False)  # an entity: compared by identity, which keeps `in`/`remove` cheap
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Any of these ends the request (models such as Llama-3 instruct have several).
    eos_token_ids: frozenset[int] = frozenset()
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens of the prompt found in the prefix cache at the latest admission.
    num_cached_tokens: int = 0
    # Tokens whose KV arrives from another worker (disaggregated decode), not computed here.
    num_external_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Chained hashes of the full blocks of `all_token_ids` computed so far (for the block
    # size of the block manager holding the request, which alone extends it). Tokens never
    # change once appended, so the hashes are computed once per block, not per lookup.
    block_hashes: list[int] = field(default_factory=list)
    # Set by the scheduler when the request finishes: the `kv_transfer_params` its KV
    # connector hands to the next leg (a prefill leg's: where its leased blocks wait).
    kv_hand_off: dict | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before this request can sample again."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token is uncomputed (a prompt, or a preempted
        request recomputing its context); False for a plain decode step."""
        return self.num_remaining_tokens > 1 or self.num_output_tokens == 0

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Token-level stop conditions after the latest appended token (stop strings live
        in the detokenizer, which reports them back through the engine)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        if self.num_output_tokens < params.min_tokens:
            return None
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
        return None


@dataclass
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens from its `num_computed_tokens`."""

    request: Request
    num_new_tokens: int

    @property
    def is_sampling(self) -> bool:
        """Whether this step brings the request level with its tokens, so it samples one."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
