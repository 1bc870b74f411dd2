"""Runs one prepared request through the async engine and answers it, streamed or not.

Both endpoints go through `serve()`; they differ only in their `Responses` renderer. A client
that goes away aborts its request: for a stream, Starlette cancels the body iterator; for a
plain response, a watcher notices the disconnect. Either way the engine drops the request
before its next step and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.core.request import FinishReason
from pdserve.core.sampling_params import InvalidParameterError
from pdserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.server.errors import APIError, ErrorType, invalid
from pdserve.server.inputs import ModelInfo, PreparedRequest
from pdserve.server.metrics import ServerMetrics
from pdserve.server.responses import DONE_EVENT, Responses, TokenTexts
from pdserve.server.settings import ServerSettings
from pdserve.server.tracking import RequestTracker

# A client may name its request (e.g. a router correlating legs); anything else is replaced.
_REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class ServerState:
    """Everything a handler needs, built once per app."""

    engine: AsyncLLMEngine
    model: ModelInfo
    metrics: ServerMetrics
    token_texts: TokenTexts
    settings: ServerSettings


def new_request_id(http_request: Request, prefix: str) -> str:
    given = http_request.headers.get("x-request-id")
    if given is not None and _REQUEST_ID_PATTERN.fullmatch(given):
        return given
    return f"{prefix}-{uuid.uuid4().hex}"


async def serve(
    http_request: Request,
    state: ServerState,
    prepared: PreparedRequest,
    responses: Responses,
    *,
    stream: bool,
    endpoint: str,
    arrival_time: float,
) -> Response:
    """Admit the request (errors become 4xx/503 before any byte is sent) and answer it."""
    engine_stream = await _admit(state.engine, responses.request_id, prepared, arrival_time)
    tracker = RequestTracker(responses.request_id, endpoint, state.metrics, arrival_time)
    headers = {"X-Request-Id": responses.request_id}
    if stream:
        return _EngineStreamingResponse(
            _stream(engine_stream, responses, tracker, state.metrics),
            on_close=lambda: _close(engine_stream, tracker),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await _collect(
        http_request,
        state.engine,
        engine_stream,
        responses,
        tracker,
        prepared.sampling_params.logprobs is not None,
    )
    return JSONResponse(body, headers=headers)


class _EngineStreamingResponse(StreamingResponse):
    """A stream that always releases its engine request, even when the client vanished
    before the body iterator ever started (then its own `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _close(engine_stream: RequestStream, tracker: RequestTracker) -> None:
    """Idempotent: a no-op after the stream's own clean-up ran."""
    engine_stream.close()
    tracker.finish("client_disconnected")


async def _admit(
    engine: AsyncLLMEngine, request_id: str, prepared: PreparedRequest, arrival_time: float
) -> RequestStream:
    try:
        return await engine.add_request(
            request_id,
            prepared.prompt_token_ids,
            prepared.sampling_params,
            prepared.kv_transfer_params,
            arrival_time,
        )
    except EngineOverloadedError as exc:
        raise APIError(
            ErrorType.RATE_LIMIT,
            str(exc),
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from exc
    except InvalidParameterError as exc:
        raise invalid(exc.param, str(exc)) from exc
    except EngineDeadError as exc:
        raise APIError(ErrorType.UNAVAILABLE, str(exc)) from exc
    except ValueError as exc:  # a client-chosen X-Request-Id already in use
        raise invalid(None, str(exc)) from exc


async def _stream(
    engine_stream: RequestStream,
    responses: Responses,
    tracker: RequestTracker,
    metrics: ServerMetrics,
) -> AsyncIterator[str]:
    status = "ok"
    try:
        for event in responses.opening_chunks():
            yield event
        final: RequestOutput | None = None
        async for output in engine_stream:
            _raise_if_failed(output)
            tracker.observe(output)
            responses.observe(output)
            event = responses.chunk(output)
            if event is not None:
                yield event
            if output.finished:
                final = output
        if final is not None and responses.include_usage:
            yield responses.usage_chunk(final)
        yield DONE_EVENT
    except (RequestFailedError, EngineDeadError) as exc:
        # Headers are gone already: the error travels as an event, then the stream ends.
        status = "error"
        error = _engine_failure(exc)
        metrics.count_error(error.error_type.type_name)
        yield error.sse_event()
        yield DONE_EVENT
    except (asyncio.CancelledError, GeneratorExit):
        status = "client_disconnected"
        raise
    finally:
        engine_stream.close()
        tracker.finish(status)


async def _collect(
    http_request: Request,
    engine: AsyncLLMEngine,
    engine_stream: RequestStream,
    responses: Responses,
    tracker: RequestTracker,
    wants_logprobs: bool,
) -> dict:
    watcher = asyncio.create_task(
        _abort_on_disconnect(http_request, engine, engine_stream.request_id)
    )
    texts: list[str] = []
    logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
    final: RequestOutput | None = None
    status = "ok"
    try:
        async for output in engine_stream:
            _raise_if_failed(output)
            tracker.observe(output)
            responses.observe(output)
            texts.append(output.new_text)
            if logprobs is not None and output.logprobs:
                logprobs.extend(output.logprobs)
            if output.finished:
                final = output
    except (RequestFailedError, EngineDeadError) as exc:
        status = "error"
        raise _engine_failure(exc) from exc
    finally:
        watcher.cancel()
        engine_stream.close()
        tracker.finish(status)
    assert final is not None  # a stream always ends with a finished output or an error
    return responses.full("".join(texts), logprobs, final)


async def _abort_on_disconnect(
    http_request: Request, engine: AsyncLLMEngine, request_id: str
) -> None:
    """The body is read already, so the next ASGI message is the disconnect."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(request_id)


def _raise_if_failed(output: RequestOutput) -> None:
    """A request the engine ended with an error (e.g. its KV never arrived under
    --kv-failure-policy fail) is answered as a failure, not as a normal finish."""
    if output.finished and output.finish_reason is FinishReason.ERROR:
        transfer = output.kv_transfer
        cause = (
            f"KV transfer failed: {transfer.error}"
            if transfer and transfer.error
            else "the engine failed the request"
        )
        raise RequestFailedError(cause)


def _engine_failure(exc: Exception) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(ErrorType.UNAVAILABLE, str(exc))
    return APIError(ErrorType.INTERNAL, str(exc), code="engine_error")
