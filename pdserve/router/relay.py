"""Relay a decode worker's SSE stream to the client, and the SSE framing it reads.

Events pass through byte for byte. The router only looks into an event carrying
``pdserve_timing`` (the final usage chunk) to record the worker's timing, and drops that chunk
when the router itself asked for usage the client did not. A stream that breaks or ends
without ``data: [DONE]`` is closed with an SSE error event and ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from pdserve.api.asgi import DONE_EVENT, sse_event
from pdserve.api.errors import APIError, ErrorType
from pdserve.router.timing import RequestTiming, extract_worker_timing

_TIMING_MARKER = b'"pdserve_timing"'


async def relay_events(
    upstream: httpx.Response,
    timing: RequestTiming,
    *,
    strip_usage: bool,
    on_broken: Callable[[str, bool], None],
) -> AsyncIterator[bytes]:
    """The client's stream. `on_broken(reason, is_transport_error)` is called when the
    upstream stream fails or ends early."""
    is_done = False
    try:
        async for event in iter_sse_events(upstream.aiter_bytes()):
            timing.mark_first_byte()
            if is_done_event(event):
                is_done = True
            elif _TIMING_MARKER in event and _absorb_timing(event, timing) and strip_usage:
                continue
            yield event
    except httpx.TransportError as exc:
        reason = f"decode worker stream broke: {type(exc).__name__}: {exc}"
        on_broken(reason, True)
    else:
        reason = "decode worker closed the stream before [DONE]"
        if not is_done:
            on_broken(reason, False)
    if not is_done:
        error = APIError(ErrorType.BAD_GATEWAY, reason, code="decode_stream_broken")
        yield sse_event(error.body()).encode()
        yield DONE_EVENT.encode()


def _absorb_timing(event: bytes, timing: RequestTiming) -> bool:
    """Record the worker timing in `event`; True if it is a usage-only chunk (no choices)."""
    chunk = event_json(event)
    reported = extract_worker_timing(chunk)
    if reported is None:
        return False
    timing.take_worker_report(reported)
    return not chunk.get("choices")


# ---- Server-Sent Events framing -------------------------------------------------------------
_SEPARATORS = (b"\n\n", b"\r\n\r\n")
_DONE = DONE_EVENT.encode().strip()


async def iter_sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole events, each with its blank-line terminator, bytes unchanged. A trailing partial
    event (the sender died mid-event) is dropped."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := _event_end(buffer)) is not None:
            yield buffer[:end]
            buffer = buffer[end:]


def _event_end(buffer: bytes) -> int | None:
    ends = [i + len(sep) for sep in _SEPARATORS if (i := buffer.find(sep)) >= 0]
    return min(ends) if ends else None


def is_done_event(event: bytes) -> bool:
    return event.strip() == _DONE


def event_json(event: bytes) -> Any:
    """The JSON of an event's data lines, or None if it has none or they are not JSON."""
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None
