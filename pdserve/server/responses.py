"""Response bodies and SSE chunks in OpenAI's formats, for completions and chat completions.

One `Responses` object per request renders the engine's outputs: `chunk()` for each streamed
increment, `usage_chunk()` for `stream_options.include_usage`, `full()` for a non-streamed
answer. The two endpoints differ only in how a choice looks (`text` vs `delta`/`message`) and
how logprobs are laid out, which the subclasses define.
"""

from __future__ import annotations

import time

from pdserve.api.asgi import sse_event
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.server.inputs import Tokenizer
from pdserve.server.worker_timing import WorkerTiming

# JSON has no -Infinity: masked tokens get this floor instead (vLLM does the same).
MIN_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> its text, cached (logprobs name tokens by text; the vocabulary is finite).

    A token that is only part of a UTF-8 character decodes to U+FFFD, as in vLLM."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def finite_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN to the floor


def usage(output: RequestOutput) -> dict:
    body = {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": output.num_output_tokens,
        "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
    }
    if output.num_cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": output.num_cached_tokens}
    return body


class Responses:
    """Shared envelope; subclasses render choices and logprobs."""

    object_name = ""
    chunk_object_name = ""
    # Response ids are `{id_prefix}-{hex}`; `endpoint` names the request in logs.
    id_prefix = ""
    endpoint = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        token_texts: TokenTexts,
        include_usage: bool = False,
        router_timing: dict | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._token_texts = token_texts
        self.include_usage = include_usage
        # Only a routed request (it carries router_timing) gets `pdserve_timing` back.
        self._timing = WorkerTiming(router_timing) if router_timing is not None else None

    def observe(self, output: RequestOutput) -> None:
        """Call for every engine output, streamed or not (timing for `pdserve_timing`)."""
        if self._timing is not None:
            self._timing.observe(output)

    # ---- streaming -------------------------------------------------------------------------
    def opening_chunks(self) -> list[str]:
        return []

    def chunk(self, output: RequestOutput) -> str | None:
        """The SSE event for one engine output, or None when it carries nothing to send."""
        if not (output.new_text or output.logprobs or output.finished or output.kv_transfer_params):
            return None
        finish_reason = output.finish_reason.value if output.finished else None
        choice = self._stream_choice(output.new_text, output.logprobs, finish_reason)
        payload = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            payload["usage"] = None
        if output.kv_transfer_params is not None:  # a hand-off (final, or announced early)
            payload["kv_transfer_params"] = output.kv_transfer_params
        return sse_event(payload)

    def usage_chunk(self, final: RequestOutput) -> str:
        payload = self._envelope(self.chunk_object_name, [])
        payload["usage"] = usage(final)
        if self._timing is not None:
            payload["pdserve_timing"] = self._timing.report(final)
        return sse_event(payload)

    # ---- non-streaming ---------------------------------------------------------------------
    def full(self, text: str, logprobs: list[TokenLogprob] | None, final: RequestOutput) -> dict:
        finish_reason = final.finish_reason.value if final.finish_reason else None
        body = self._envelope(self.object_name, [self._full_choice(text, logprobs, finish_reason)])
        body["usage"] = usage(final)
        if final.kv_transfer_params is not None:
            body["kv_transfer_params"] = final.kv_transfer_params
        if self._timing is not None:
            body["pdserve_timing"] = self._timing.report(final)
        return body

    # ---- per endpoint ----------------------------------------------------------------------
    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _stream_choice(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None
    ) -> dict:
        raise NotImplementedError

    def _full_choice(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None
    ) -> dict:
        raise NotImplementedError


class CompletionResponses(Responses):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"
    endpoint = "completions"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text_offset = 0  # characters of output before the next logprob entry

    def _stream_choice(self, text, logprobs, finish_reason) -> dict:
        return self._full_choice(text, logprobs, finish_reason)

    def _full_choice(self, text, logprobs, finish_reason) -> dict:
        return {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        tokens = [self._token_texts(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [finite_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [
                {self._token_texts(t): finite_logprob(v) for t, v in lp.top_logprobs}
                for lp in logprobs
            ],
            "text_offset": offsets,
        }


class ChatResponses(Responses):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    endpoint = "chat"

    def opening_chunks(self) -> list[str]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        payload = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            payload["usage"] = None
        return [sse_event(payload)]

    def _stream_choice(self, text, logprobs, finish_reason) -> dict:
        delta = {"content": text} if text else {}
        return {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def _full_choice(self, text, logprobs, finish_reason) -> dict:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(t, v) for t, v in lp.top_logprobs],
                }
                for lp in logprobs
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_texts(token_id)
        return {
            "token": text,
            "logprob": finite_logprob(logprob),
            "bytes": list(text.encode("utf-8")),
        }
