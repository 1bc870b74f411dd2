"""OpenAI-style error bodies the router itself produces."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
}


class RouterHTTPError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(
            self.message,
            _TYPES.get(self.status, "router_error"),
            self.param,
            self.code or str(self.status),
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_error_event(message: str, error_type: str = "upstream_error", code: str = "502") -> bytes:
    """A ``data: {"error": ...}`` SSE event (the stream then ends with ``data: [DONE]``)."""
    return b"data: " + json.dumps(error_body(message, error_type, None, code)).encode() + b"\n\n"
