"""Streaming OpenAI-API client: one request in, one `RequestRecord` out.

Works against any OpenAI-compatible server (pdserve, vLLM, llama.cpp): it needs only SSE
`data:` lines with `choices`, and reads `usage` from the final chunk when the server sends it.
"""

from __future__ import annotations

import json
import time

import httpx

from pdserve.workload.base import BenchRequest
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.records import RequestRecord

# Usage keys with a fixed meaning; anything else in `usage` is kept as server extra.
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
# Top-level chunk keys of the OpenAI schema; others (e.g. llama.cpp's `timings`) are kept.
_CHUNK_KEYS = frozenset(
    {"id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier"}
)


def make_http_client(config: EndpointConfig) -> httpx.AsyncClient:
    """An async HTTP client without a connection-pool cap: the arrival process (and
    --max-concurrency) decides how many requests are in flight, not the pool."""
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=config.headers)


async def fetch_models(http: httpx.AsyncClient, config: EndpointConfig) -> list[dict]:
    """The server's `GET /v1/models` entries."""
    try:
        response = await http.get(config.url("/v1/models"))
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {config.base_url}: {exc!r}") from exc
    if response.status_code != 200:
        raise BenchError(
            f"GET {config.url('/v1/models')} returned HTTP {response.status_code}: "
            f"{response.text[:200]}"
        )
    try:
        models = response.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"GET {config.url('/v1/models')}: not an OpenAI model list") from None
    if not models:
        raise BenchError(f"{config.base_url} serves no models")
    return models


async def send_request(
    http: httpx.AsyncClient,
    config: EndpointConfig,
    model: str,
    request: BenchRequest,
    record: RequestRecord,
    t0: float,
) -> None:
    """Stream one request, filling `record` (times relative to `t0`, a perf_counter value).

    Never raises for server or network failures: they end up in `record.error`.
    """
    reader = _StreamReader(config.is_chat, record, t0)
    record.send_time = time.perf_counter() - t0
    try:
        async with http.stream(
            "POST", config.url(config.endpoint), json=config.payload(request, model)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
            else:
                async for line in response.aiter_lines():
                    if not reader.feed(line):
                        break
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_time = time.perf_counter() - t0
    reader.finish()


class _StreamReader:
    """Turns SSE lines into a record; one per request."""

    def __init__(self, is_chat: bool, record: RequestRecord, t0: float) -> None:
        self._is_chat = is_chat
        self._record = record
        self._t0 = t0
        self._text: list[str] = []

    def feed(self, line: str) -> bool:
        """Consume one line; False once the stream is over ([DONE] or an error event)."""
        now = time.perf_counter() - self._t0
        if not line.startswith("data:"):
            return True  # blank separators, comments, event names
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return False
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self._record.error = f"malformed SSE data: {data[:200]}"
            return False
        if "error" in chunk:
            self._record.error = f"server error event: {json.dumps(chunk['error'])[:300]}"
            return False
        self._take(chunk, now)
        return True

    def _take(self, chunk: dict, now: float) -> None:
        for choice in chunk.get("choices") or []:
            text = _token_text(choice, self._is_chat)
            if text is not None:
                self._record.token_times.append(now)
                self._text.append(text)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._take_usage(usage)
        extra = {k: v for k, v in chunk.items() if k not in _CHUNK_KEYS}
        self._record.server_extra.update(extra)

    def _take_usage(self, usage: dict) -> None:
        record = self._record
        if isinstance(usage.get("completion_tokens"), int):
            record.num_output_tokens = usage["completion_tokens"]
            record.is_usage_reported = True
        if isinstance(usage.get("prompt_tokens"), int):
            record.num_prompt_tokens_reported = usage["prompt_tokens"]
        record.server_extra.update({k: v for k, v in usage.items() if k not in _USAGE_COUNTS})

    def finish(self) -> None:
        record = self._record
        record.generated_text = "".join(self._text)
        if not record.is_usage_reported:
            record.num_output_tokens = len(record.token_times)
        if record.error is None and not record.token_times:
            record.error = "the stream ended without any content chunk"


def _token_text(choice: dict, is_chat: bool) -> str | None:
    """The text a choice carries if it stands for generated tokens, else None.

    Counted, as `vllm bench serve` counts them: every chunk with choices, including empty-text
    ones (a token whose text is held back). Not counted: a chat preamble that only announces
    the role, and a trailer that only carries the finish reason; both carry no token.
    """
    if is_chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
        is_bare = not text and ("role" in delta or choice.get("finish_reason") is not None)
    else:
        text = choice.get("text") or ""
        is_bare = not text and choice.get("finish_reason") is not None
    return None if is_bare else text
