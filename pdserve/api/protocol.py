"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types), for the server
and the router alike.

Field names and meanings follow the OpenAI API plus vLLM's extensions (`top_k`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, `kv_transfer_params`). Types are strict so a wrong-typed field
is a 400 naming it rather than a silent coercion; unknown fields are ignored, as vLLM does.
Checks that depend on the model (name, context length, vocabulary) live in
`pdserve.server.inputs`. The router checks only `RoutedRequest` itself and relays the
worker's answer to the rest, so both give the same 400 for the same body.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.core.sampling_params import MAX_TOKENS_LIMIT

MAX_LOGPROBS = 20
# OpenAI allows any integer seed; torch generators take 64 bits.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

TokenIds = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class RoutedRequest(_Body):
    """What the router reads of a generation request before it relays the body untouched
    (it branches on `stream`); the workers validate the rest."""

    stream: bool | None = False


class _GenerationRequest(RoutedRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="served model name; omitted means the default")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="default 1")
    top_k: int | None = Field(None, ge=-1, description="-1, 0 or null disable top-k")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    n: int | None = Field(None, ge=1, le=1, description="only n=1 is supported")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="unsupported: 0")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="unsupported: 0")
    user: str | None = None
    # Disaggregated serving (docs/architecture.md): passed to the engine untouched.
    kv_transfer_params: dict | None = None
    # Set by the router on a decode leg; echoed back in `pdserve_timing` (server/worker_timing.py).
    router_timing: dict | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is text or token ids (a list of one is accepted)."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = Field(None, description="not supported; must be false")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions; the prompt is the model's chat template over `messages`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = Field(None, max_length=0, description="not supported")


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: text parts joined, and "developer" (OpenAI's
    newer name for the system role) spelled "system". The server and the router's tokenizer
    both render through this, so their prompt ids agree."""
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]


class RoleChange(_Body):
    """``POST /role`` on a worker, ``POST /workers/{id}/role`` on the router: drain, then
    serve as the other pool's worker (same process, same weights)."""

    role: Literal["prefill", "decode"]
    timeout_s: float = Field(
        120.0, gt=0, le=3600, description="how long in-flight work may take to finish"
    )
