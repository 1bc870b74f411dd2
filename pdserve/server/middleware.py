"""Pure-ASGI guards that run before any body parsing: API key (401) and body size (413).

Pure ASGI (not Starlette's BaseHTTPMiddleware) so they add no task or buffering per request
and never interfere with streaming responses.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.errors import APIError, ErrorType


class ApiKeyMiddleware:
    """Every request under `/v1/` needs `Authorization: Bearer <api_key>`."""

    def __init__(
        self, app: ASGIApp, api_key: str, on_error: Callable[[APIError, str], None]
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(
                    ErrorType.AUTHENTICATION,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                self._on_error(error, scope["path"])
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Requests whose body exceeds `max_bytes` get 413, whether announced by Content-Length
    or discovered while streaming in (chunked transfer encoding)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_error: Callable[[APIError, str], None]
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._on_error = on_error

    def _error(self, scope: Scope) -> APIError:
        error = APIError(
            ErrorType.REQUEST_TOO_LARGE,
            f"request body exceeds the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        self._on_error(error, scope["path"])
        return error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._error(scope).response()(scope, receive, send)
            return
        state = {"received": 0, "too_large": False, "started": False}

        async def limited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes:
                    state["too_large"] = True
                    # Pretend the body ended; the app's response is replaced below.
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            if state["too_large"]:
                if message["type"] == "http.response.start" and not state["started"]:
                    state["started"] = True
                    await self._error(scope).response()(scope, receive, send)
                return  # drop the app's own answer to a truncated body
            await send(message)

        await self.app(scope, limited_receive, guarded_send)
