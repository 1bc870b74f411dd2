"""The HTTP plumbing both apps share: guards that run before any body parsing (API key 401, or
on a fleet's worker its request signature 401, body size 413), the client-disconnect watcher,
the streaming response that always cleans up, and the start-up heap frozen before serving.

The guards are pure ASGI (not Starlette's BaseHTTPMiddleware) so they add no task or buffering
per request and never interfere with streaming responses.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.errors import APIError, ErrorType, OnError, install_handlers
from pdserve.api.openapi import document_front_door
from pdserve.api.signing import ReplayGuard, canonical, parse_header, signature, signing_key

T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"
# What a client that left before its response started is "answered" (nginx's code).
CLIENT_CLOSED_STATUS = 499


def freeze_startup_heap() -> None:
    """Puts every object alive once a server is up (the libraries', the model's, the
    tokenizer's: millions) beyond the garbage collector's reach, so that a full collection
    scans only what serving allocates: it holds the GIL, so every stream's step or relay
    waits for it. Left in reach, one took 100-190 ms in `pdserve serve` on Zen 4, and one in
    a 32-stream burst put its ITL p99 at ~115 ms (~40 ms without). The start-up objects live
    as long as the process, so freezing them leaks nothing. Turns the collector on (start-up
    may run with it off)."""
    gc.collect()
    gc.freeze()
    gc.enable()


def install_front_door(
    app: FastAPI,
    *,
    api_key: str | None,
    protected_prefixes: Sequence[str],
    max_body_bytes: int,
    on_error: OnError = lambda error, path: None,
    fleet_secret: str | None = None,
) -> None:
    """The OpenAI error handlers and the guards, in their order: a request without the key
    is refused before its body is read (added last = runs first); the OpenAPI document
    states their answers.

    `fleet_secret`: this app is a deployment's worker (`pdserve.fleet`), which answers only its
    fleet: every path but ``/health`` needs a request signed with the secret (`api.signing`;
    checked inside the body-size guard, since the signature covers the body), and the user's
    `api_key` (checked by the router in front) is not taken here."""
    install_handlers(app, on_error)
    document_front_door(app, protected_prefixes=None if api_key is None else protected_prefixes)
    app.add_exception_handler(ClientDisconnected, _client_closed)
    if fleet_secret is not None:
        app.add_middleware(
            FleetSignatureMiddleware,
            secret=fleet_secret,
            on_error=on_error,
            open_paths=("/health",),
        )
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes, on_error=on_error)
    if fleet_secret is None and api_key is not None:
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=api_key,
            protected_prefixes=tuple(protected_prefixes),
            on_error=on_error,
        )


class ApiKeyMiddleware:
    """Every request whose path starts with one of `protected_prefixes` needs
    `Authorization: Bearer <api_key>` (the scheme in any case)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        protected_prefixes: tuple[str, ...],
        on_error: OnError,
    ) -> None:
        self.app = app
        self._expected = api_key.encode()
        self._prefixes = protected_prefixes
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(self._prefixes)
            and not self._is_authorized(scope)
        ):
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

    def _is_authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self._expected)


class FleetSignatureMiddleware:
    """Every request but `open_paths` must carry a fresh fleet signature (`api.signing`): its
    header is checked before the body is read, the MAC over the body after; a nonce is
    admitted once. The body is then handed to the app as read."""

    def __init__(
        self, app: ASGIApp, secret: str, on_error: OnError, open_paths: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self._key = signing_key(secret)
        self._open_paths = frozenset(open_paths)
        self._on_error = on_error
        self._replays = ReplayGuard()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        signed = parse_header(headers.get(b"authorization", b""))
        if signed is None:
            await self._refuse(scope, receive, send, "missing or malformed fleet signature")
            return
        if not self._replays.is_in_window(signed.unix_time, time.time()):
            await self._refuse(scope, receive, send, "fleet signature outside the clock window")
            return
        buffered = await _buffered(receive)
        if buffered is None:
            return  # the client left before its body arrived
        body, receive = buffered
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        message = canonical(
            scope["method"],
            headers.get(b"host", b"").decode("latin-1"),
            target.decode("latin-1"),
            signed.timestamp,
            signed.nonce,
            body,
        )
        if not hmac.compare_digest(signature(self._key, message), signed.signature):
            await self._refuse(scope, receive, send, "wrong fleet signature")
            return
        if not self._replays.admit(signed.nonce, signed.unix_time, time.time()):
            await self._refuse(scope, receive, send, "replayed fleet signature")
            return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, reason: str) -> None:
        error = APIError(
            ErrorType.AUTHENTICATION,
            f"{reason}: this worker answers only its deployment's router",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Fleet"},
        )
        self._on_error(error, scope["path"])
        await error.response()(scope, receive, send)


async def _buffered(receive: Receive) -> tuple[bytes, Receive] | None:
    """The whole request body, and a `receive` that hands it on as one message, then passes
    through (the disconnect watcher's ``http.disconnect``); None if the client left first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return body, replay


class BodySizeLimitMiddleware:
    """Requests whose body exceeds `max_bytes` get 413, whether announced by Content-Length
    or discovered while streaming in (chunked transfer encoding)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: OnError) -> None:
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


class ClientDisconnected(Exception):
    """The client closed its connection before the response started."""


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, unless the client goes away first: then it is cancelled and
    `ClientDisconnected` raised.

    Before a response starts nothing else listens for the client's ``http.disconnect``; this
    races the work against it (a cancelled engine request is aborted, a cancelled upstream
    call closes its connection, which the worker sees as its client leaving)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _client_closed(_: Request, __: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


class ManagedStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its content and runs `on_close` once it is over:
    finished, failed, or cancelled by the client's disconnect, even before the content ever
    started (then the content's own `finally` never runs). Shielded, so the cancellation
    cannot skip it."""

    def __init__(
        self,
        content: AsyncGenerator[str | bytes, None],
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


def sse_event(payload: dict) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
