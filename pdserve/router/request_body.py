"""Read and minimally check a client's JSON body (the workers validate the rest)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from pdserve.router.errors import RouterHTTPError


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a dict; 413 over `max_bytes`, 400 for non-JSON, non-objects or a
    non-boolean ``stream`` (the router branches on it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    raw = await request.body()
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise RouterHTTPError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RouterHTTPError(400, "request body must be a JSON object")
    if body.get("stream") is None:
        body.pop("stream", None)
    elif not isinstance(body["stream"], bool):
        raise RouterHTTPError(400, "stream must be a boolean", param="stream")
    return body


def _too_large(max_bytes: int) -> RouterHTTPError:
    return RouterHTTPError(413, f"request body exceeds {max_bytes} bytes")
