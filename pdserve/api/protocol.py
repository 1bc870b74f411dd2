"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types) and the shapes of
their answers, for the server and the router alike.

Validation and the published OpenAPI document come from these models: every rule a body can
break whatever model is served is a constraint here (a length, a range, a required-one-of, a
field that needs another), so a body the document allows is one the server accepts, and the
router, validating with the same models, answers a bad body with the server's own 400. What
JSON Schema cannot state is in the field descriptions: what depends on the served model (its
name, context window, vocabulary; `pdserve.server.inputs` checks it) and min_tokens <=
max_tokens (`SamplingParams`).

Field names and meanings follow the OpenAI API plus vLLM's extensions (`top_k`, `ignore_eos`,
`min_tokens`, `stop_token_ids`). Types are strict so a wrong-typed field is a 400 naming it
rather than a silent coercion; unknown fields are ignored, as vLLM does. The disaggregated
hand-off's fields (`kv_transfer_params`, `router_timing`) are set by pdserve's router on its
legs to the workers: accepted, but not part of the published API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    WrapValidator,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from pdserve.core.sampling_params import MAX_TOKENS_LIMIT

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"

MAX_LOGPROBS = 20
# OpenAI allows any integer seed; torch generators take 64 bits.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Stop strings are searched on every step, so their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256

_CONTEXT_NOTE = (
    "the prompt's tokens plus this must fit the model's context window (`max_model_len` "
    "in GET /v1/models)"
)


def _whole_number(value: Any) -> Any:
    # JSON Schema counts 2.0 as the integer 2, and so do we (strict mode alone would not).
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**bounds: int) -> Any:
    """An integer type within `bounds` (`Field`'s ge/le), whole floats included."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


def _false(value: bool) -> bool:
    if value:
        raise PydanticCustomError("unsupported", "not supported: must be false")
    return value


# `Literal[False]` would take 0 (0 == False); this takes exactly false.
FalseOnly = Annotated[
    bool, AfterValidator(_false), WithJsonSchema({"type": "boolean", "const": False})
]
MaxTokens = _int(ge=1, le=MAX_TOKENS_LIMIT)
# Published as OpenAPI's int64 rather than as bounds past 2**53, which tools read as floats.
Seed = Annotated[
    _int(ge=SEED_MIN, le=SEED_MAX), WithJsonSchema({"type": "integer", "format": "int64"})
]
NumLogprobs = _int(ge=0, le=MAX_LOGPROBS)
TokenId = _int(ge=0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


def _one_prompt(value: Any, handler: Any) -> Any:
    """A batch (a list of several prompts), which the schema already excludes, is refused
    in words a client recognizes rather than as a list too long."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise PydanticCustomError(
            "batched_prompt",
            "batched prompts are not supported: send one prompt per request (got {count})",
            {"count": len(value)},
        )
    return handler(value)


# Text or token ids; a list of exactly one of those is accepted as OpenAI's batch of one.
Prompt = Annotated[
    Text
    | TokenIds
    | Annotated[list[Text], Field(min_length=1, max_length=1)]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=1)],
    WrapValidator(_one_prompt),
]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    stream: bool | None = Field(
        False, description="true: the answer is server-sent events (text/event-stream)"
    )
    model: str | None = Field(
        None, description="a served model name (GET /v1/models); omitted means the default"
    )
    max_tokens: MaxTokens | None = Field(None, description=_CONTEXT_NOTE)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="default 1")
    top_k: _int(ge=-1) | None = Field(None, description="-1, 0 or null disable top-k")
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="ids below the model's vocabulary size"
    )
    n: _int(ge=1, le=1) | None = Field(None, description="only n=1 is supported")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: _int(ge=0, le=MAX_TOKENS_LIMIT) | None = Field(
        None,
        description="at most the request's max_tokens (default: 16 for completions, the "
        "rest of the context window for chat)",
    )
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="unsupported: 0")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="unsupported: 0")
    user: str | None = None
    # The disaggregated hand-off (docs/architecture.md), passed to the engine untouched.
    kv_transfer_params: SkipJsonSchema[dict | None] = None
    # Set by the router on a decode leg; echoed back in `pdserve_timing` (server/worker_timing.py).
    router_timing: SkipJsonSchema[dict | None] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Prompt = Field(
        description="text, or token ids (below the model's vocabulary size); a list of one "
        "of those is a batch of one (larger batches are not supported). Its tokens must leave "
        "room for an answer in the model's context window"
    )
    logprobs: NumLogprobs | None = None
    echo: FalseOnly | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


# OpenAI's roles that take no tool calls; "tool" and "function" turns need tools.
Role = Literal["system", "developer", "user", "assistant"]
# Every turn but the assistant's needs content (OpenAI's rule: an assistant's may be omitted).
_ROLES_WITH_CONTENT = ("system", "developer", "user")
_TOOL_ROLES = ("tool", "function")


class ChatMessage(_Body):
    """One turn: text, or text parts (`[{"type": "text", "text": ...}]`) joined."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"role": {"enum": list(_ROLES_WITH_CONTENT)}}},
            "then": {
                "required": ["content"],
                "properties": {"content": {"type": ["string", "array"]}},
            },
        }
    )

    role: Role
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        None,
        validate_default=True,
        description="required unless the role is assistant",
    )
    name: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _no_tools(cls, role: Any) -> Any:
        if role in _TOOL_ROLES:
            raise PydanticCustomError(
                "unsupported_role",
                "'{role}' messages answer tool calls, which pdserve does not support; roles "
                "are 'system', 'developer', 'user' and 'assistant'",
                {"role": role},
            )
        return role

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")  # absent when the role itself was refused
        if content is None and role in _ROLES_WITH_CONTENT:
            raise PydanticCustomError(
                "missing", "Field required in a {role} message", {"role": role}
            )
        return content

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

    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"top_logprobs": {"type": "integer"}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )

    messages: list[ChatMessage] = Field(
        min_length=1,
        description="the conversation; its rendered template must fit the model's context",
    )
    max_completion_tokens: MaxTokens | None = Field(
        None, description="replaces max_tokens; " + _CONTEXT_NOTE
    )
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = Field(None, description="needs logprobs: true")
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = Field(None, max_length=0, description="not supported")

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and info.data.get("logprobs") is not True:
            raise PydanticCustomError("dependency", "requires logprobs to be true")
        return top_logprobs


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["prompt"],
                    "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
                },
                {
                    "required": ["messages"],
                    "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}},
                },
            ]
        }
    )

    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, validate_default=True
    )
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _exactly_one(cls, messages: Any, info: ValidationInfo) -> Any:
        # A refused prompt is reported as itself, not as missing.
        if "prompt" in info.data and (info.data["prompt"] is None) == (messages is None):
            raise PydanticCustomError("one_of", "give exactly one of prompt and messages")
        return messages


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: text parts joined, and "developer" (OpenAI's
    newer name for the system role) spelled "system". The server and the router's tokenizer
    both render through this, so their prompt ids agree."""
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]


# ---- answers (for the OpenAPI document; `pdserve.server.responses` renders them) -----------
FinishReason = Literal["stop", "length", "abort"]


class _Answer(BaseModel):
    pass


class PromptTokensDetails(_Answer):
    cached_tokens: int


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="present when part of the prompt came from the prefix cache"
    )


class _Envelope(_Answer):
    id: str
    created: int
    model: str
    # The disaggregated hand-off (see the request's note): only on a worker's legs.
    kv_transfer_params: dict | None = None
    pdserve_timing: dict[str, float | str] | None = Field(
        None, description="only on a request routed by pdserve's router: where its time went"
    )


class _GenerationAnswer(_Envelope):
    usage: Usage


class _Chunk(_Envelope):
    usage: Usage | None = Field(
        None,
        description="with stream_options.include_usage: null, then on a last chunk without choices",
    )


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionResponse(_GenerationAnswer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class CompletionChunk(_Chunk):
    """One event of a streamed completion: the choice's `text` is the increment."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[TokenLogprob]


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(_GenerationAnswer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = Field(None, description="on the first chunk only")
    content: str | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Chunk):
    """One event of a streamed chat completion: `delta.content` is the increment."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class TokenizeResponse(_Answer):
    tokens: list[int]
    count: int
    max_model_len: int


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class RoleChange(_Body):
    """``POST /role`` on a worker, ``POST /workers/{id}/role`` on the router: drain, then
    serve as the other pool's worker (same process, same weights)."""

    role: Literal["prefill", "decode"]
    timeout_s: float = Field(
        120.0, gt=0, le=3600, description="how long in-flight work may take to finish"
    )


class RoleSwitched(_Answer):
    """A worker's answer to ``POST /role``: the seconds it waited for its engine to empty and
    the switch took."""

    role: Literal["prefill", "decode"]
    previous_role: Literal["prefill", "decode"]
    drain_s: float
    switch_s: float
