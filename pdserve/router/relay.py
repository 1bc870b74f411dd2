"""Relay a decode worker's SSE stream to the client, and clean up whatever ends it.

Events pass through byte for byte. The router only looks into an event carrying
``pdserve_timing`` (the final usage chunk) to record the worker's timing, and drops that chunk
when the router itself asked for usage the client did not. A stream that breaks or ends
without ``data: [DONE]`` is closed with an SSE error event and ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.errors import sse_error_event
from pdserve.router.sse import SSE_DONE, event_json, is_done_event, iter_sse_events
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
        yield sse_error_event(reason)
        yield SSE_DONE


def _absorb_timing(event: bytes, timing: RequestTiming) -> bool:
    """Record the worker timing in `event`; True if it is a usage-only chunk (no choices)."""
    chunk = event_json(event)
    reported = extract_worker_timing(chunk)
    if reported is None:
        return False
    timing.worker.update(reported)
    return not chunk.get("choices")


class ManagedStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` once it is over: finished, failed, or
    cancelled by the client's disconnect (shielded, so the cancellation cannot skip it)."""

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        on_close: Callable[[], Awaitable[None]],
        **kwargs,
    ) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._content.aclose()
                await self._on_close()
