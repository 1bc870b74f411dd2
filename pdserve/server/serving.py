"""Runs one prepared request through the async engine and answers it, streamed or not.

Both endpoints go through `serve()`; they differ only in their `Responses` renderer. A client
that goes away aborts its request: for a stream, Starlette cancels the body iterator; for a
plain response, `until_disconnected` cancels the collection. Either way the engine drops the
request before its next step and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.api.asgi import DONE_EVENT, ManagedStreamingResponse, sse_event, until_disconnected
from pdserve.api.errors import APIError, ErrorType, invalid
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
from pdserve.server.inputs import ModelInfo, PreparedRequest
from pdserve.server.metrics import ServerMetrics
from pdserve.server.responses import Responses, TokenTexts
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
    arrival_time: float,
) -> Response:
    """Admit the request (errors become 4xx/503 before any byte is sent) and answer it."""
    engine_stream = await _admit(state.engine, responses.request_id, prepared, arrival_time)
    tracker = RequestTracker(responses.request_id, responses.endpoint, state.metrics, arrival_time)
    headers = {"X-Request-Id": responses.request_id}
    if stream:

        async def on_close() -> None:
            # A no-op after the stream's own clean-up ran (both are idempotent).
            engine_stream.close()
            tracker.finish("client_disconnected")

        return ManagedStreamingResponse(
            _stream(engine_stream, responses, tracker, state.metrics),
            on_close,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    wants_logprobs = prepared.sampling_params.logprobs is not None
    body = await until_disconnected(
        http_request, _collect(engine_stream, responses, tracker, wants_logprobs)
    )
    return JSONResponse(body, headers=headers)


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
) -> AsyncGenerator[str, None]:
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
        yield sse_event(error.body())
        yield DONE_EVENT
    except (asyncio.CancelledError, GeneratorExit):
        status = "client_disconnected"
        raise
    finally:
        engine_stream.close()
        tracker.finish(status)


async def _collect(
    engine_stream: RequestStream,
    responses: Responses,
    tracker: RequestTracker,
    wants_logprobs: bool,
) -> dict:
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
    except asyncio.CancelledError:
        status = "client_disconnected"
        raise
    finally:
        engine_stream.close()
        tracker.finish(status)
    assert final is not None  # a stream always ends with a finished output or an error
    return responses.full("".join(texts), logprobs, final)


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
