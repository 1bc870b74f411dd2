"""From a validated request body to what the engine takes: prompt token ids + SamplingParams.

Checks that need the model live here: served model name (404), context window, vocabulary.
Every failure is an `APIError` naming the request field. `tokenize` (POST /tokenize) computes
the prompt ids through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.api.errors import APIError, ErrorType, invalid
from pdserve.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    template_messages,
)
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.model.chat_template import ChatTemplateError

# OpenAI's default for /v1/completions; chat defaults to the rest of the context window.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Stop strings are searched on every step, so their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
    ) -> str: ...


@dataclass(frozen=True)
class ModelInfo:
    """What request preparation needs to know about the served model (immutable)."""

    served_model_names: tuple[str, ...]
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    @property
    def name(self) -> str:
        return self.served_model_names[0]


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict | None


def tokenize(body: TokenizeRequest, info: ModelInfo) -> dict:
    """POST /tokenize's answer ``{"tokens": [...], "count": n, "max_model_len": m}``: the ids
    the generation endpoints compute, so a router hashes them into the same prefix-cache blocks
    the worker will. Unlike generation, a prompt longer than the context window is not an
    error here: the caller learns its length."""
    _check_model(body.model, info)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("prompt", "give exactly one of prompt and messages")
    if body.messages is not None:
        ids = _render_chat(body.messages, body.add_generation_prompt, info)
    else:
        ids = info.tokenizer.encode(body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len}


def _check_model(model: str | None, info: ModelInfo) -> None:
    if model is not None and model not in info.served_model_names:
        raise APIError(
            ErrorType.NOT_FOUND,
            f"model {model!r} does not exist; this server "
            f"serves {', '.join(info.served_model_names)}",
            "model",
            "model_not_found",
        )


def prepare_completion(body: CompletionRequest, info: ModelInfo) -> PreparedRequest:
    _check_model(body.model, info)
    if body.echo:
        raise invalid("echo", "echo is not supported")
    prompt_ids = _completion_prompt_ids(body.prompt, info)
    max_tokens = _max_tokens(
        body.max_tokens, "max_tokens", len(prompt_ids), info, DEFAULT_COMPLETION_MAX_TOKENS
    )
    params = _sampling_params(
        body, max_tokens, body.logprobs, info, rename={"logprobs": "logprobs"}
    )
    return PreparedRequest(prompt_ids, params, body.kv_transfer_params)


def prepare_chat(body: ChatCompletionRequest, info: ModelInfo) -> PreparedRequest:
    _check_model(body.model, info)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    prompt_ids = _chat_prompt_ids(body, info)
    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = _max_tokens(requested, param, len(prompt_ids), info, default=None)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(
        body,
        max_tokens,
        num_logprobs,
        info,
        rename={"max_tokens": param, "logprobs": "top_logprobs"},
    )
    return PreparedRequest(prompt_ids, params, body.kv_transfer_params)


def _completion_prompt_ids(prompt: str | list, info: ModelInfo) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise invalid(
                "prompt",
                "batched prompts are not supported: send one prompt per "
                f"request (got {len(prompt)})",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt must not be empty")
        ids = info.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if any(not 0 <= t < info.vocab_size for t in ids):
            raise invalid("prompt", f"token ids must be in [0, {info.vocab_size})")
    if not ids:
        raise invalid("prompt", "prompt must not be empty")
    _check_context(len(ids), "prompt", info)
    return ids


def _chat_prompt_ids(body: ChatCompletionRequest, info: ModelInfo) -> list[int]:
    ids = _render_chat(body.messages, body.add_generation_prompt, info)
    _check_context(len(ids), "messages", info)
    return ids


def _render_chat(
    messages: list[ChatMessage], add_generation_prompt: bool, info: ModelInfo
) -> list[int]:
    """The prompt ids of a chat (its template rendered, then encoded); no length check."""
    try:
        text = info.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=add_generation_prompt
        )
    except ChatTemplateError as exc:
        raise invalid(
            "messages", f"the model's chat template rejected the messages: {exc}"
        ) from exc
    return info.tokenizer.encode(text)


def _check_context(num_prompt_tokens: int, param: str, info: ModelInfo) -> None:
    # At least one token must fit after the prompt.
    if num_prompt_tokens >= info.max_model_len:
        raise invalid(
            param,
            f"this model's context window is {info.max_model_len} tokens, "
            f"but the {param} has {num_prompt_tokens} tokens (at most "
            f"{info.max_model_len - 1} leave room for an answer)",
        )


def _max_tokens(
    requested: int | None, param: str, num_prompt_tokens: int, info: ModelInfo, default: int | None
) -> int:
    """An explicit request that overflows the context is an error; a default is clamped."""
    room = info.max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise invalid(
            param,
            f"this model's context window is {info.max_model_len} tokens; "
            f"the prompt has {num_prompt_tokens}, so {param} can be at most {room} "
            f"(got {requested})",
        )
    return requested


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    num_logprobs: int | None,
    info: ModelInfo,
    rename: dict[str, str],
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})")
    if any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop):
        raise invalid("stop", f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
    stop_token_ids = body.stop_token_ids or []
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=None if body.top_k is None or body.top_k <= 0 else body.top_k,
            seed=body.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=bool(body.ignore_eos),
            min_tokens=body.min_tokens or 0,
            logprobs=num_logprobs,
        )
    except InvalidParameterError as exc:
        param = rename.get(exc.param, exc.param)
        raise invalid(param, str(exc).replace(exc.param, param, 1)) from exc
