"""What the engine hands back after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

# The connectors' outcome types live with the connector contract; re-exported here.
from pdserve.core.kv_connector import KVStoreOutcome, KVTransferOutcome
from pdserve.core.request import FinishReason, RequestMetrics

__all__ = ["KVStoreOutcome", "KVTransferOutcome", "RequestOutput", "TokenLogprob"]


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The increment one `LLMEngine.step()` produced for one request.

    `new_text` is the detokenized text of `new_token_ids` (possibly empty while a multi-byte
    character is incomplete, or when held back because it could begin a stop string).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    # Set on a prefill worker's final output (disaggregated serving): where the KV lives.
    kv_transfer_params: dict | None = None
    # Set on a decode worker's outputs once the request's KV arrived (or failed to).
    kv_transfer: KVTransferOutcome | None = None
    # Set once the shared KV store's blocks for the prompt were read (or failed to be).
    kv_store: KVStoreOutcome | None = None
