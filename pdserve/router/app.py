"""The router's FastAPI app: a worker's OpenAI surface plus /workers, /health, /metrics."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterHTTPError
from pdserve.router.runtime import RouterRuntime
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.workers_api import workers_router

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def build_app(config: RouterConfig, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    """The app; its lifespan starts and stops the `RouterRuntime` (``app.state.runtime``).
    `tokenizer` None: prompts are tokenized by a worker's ``POST /tokenize``."""
    runtime = RouterRuntime(config, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.runtime = runtime
    app.add_exception_handler(RouterHTTPError, _router_error_handler)
    guarded = [Depends(_api_key_check(config.api_key))]

    @app.post(COMPLETIONS, dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await runtime.dispatcher.handle(request, COMPLETIONS)

    @app.post(CHAT_COMPLETIONS, dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await runtime.dispatcher.handle(request, CHAT_COMPLETIONS)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> Response:
        return await _proxy_models(runtime)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one decode worker is in rotation, else 503."""
        summary = {
            role.value: {"routable": len(pool.routable()), "total": len(pool.workers)}
            for role, pool in runtime.registry.pools.items()
        }
        is_up = bool(runtime.registry.decode.routable())
        return JSONResponse(
            {"status": "ok" if is_up else "unavailable", **summary},
            status_code=200 if is_up else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(workers_router(runtime), dependencies=guarded)
    return app


async def _proxy_models(runtime: RouterRuntime) -> Response:
    """A worker's /v1/models (decode workers first: every request ends on one)."""
    registry = runtime.registry
    for worker in registry.decode.routable() + registry.prefill.routable():
        try:
            upstream = await runtime.client.get(f"{worker.url}/v1/models")
        except httpx.TransportError as exc:
            runtime.health.report_failure(worker, f"/v1/models: {type(exc).__name__}")
            continue
        return Response(
            upstream.content,
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )
    raise RouterHTTPError(503, "no healthy worker", code="no_worker")


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise RouterHTTPError(
                401,
                "missing or invalid API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
            )

    return check


async def _router_error_handler(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterHTTPError)
    return exc.response()
