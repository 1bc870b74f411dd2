"""Server-Sent Events framing: split a byte stream into whole events, recognise the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"
_SEPARATORS = (b"\n\n", b"\r\n\r\n")


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
    return event.strip() == SSE_DONE.strip()


def event_json(event: bytes) -> Any:
    """The JSON of an event's data lines, or None if it has none or they are not JSON."""
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None
