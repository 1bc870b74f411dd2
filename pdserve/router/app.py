"""The router's FastAPI app: a worker's OpenAI surface plus /workers, /health, /metrics.

The front door is the server's (`pdserve.api`): the same error envelope, API key check and
body limit, so the router answers a bad request with the body a worker would. Runtime scaling:
``GET /workers``, ``POST /workers``, ``DELETE /workers/{id}`` (drain).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from pdserve.api.asgi import install_front_door
from pdserve.api.errors import ERROR_RESPONSES, APIError, ErrorType, invalid
from pdserve.api.protocol import RoutedRequest
from pdserve.router.config import RouterConfig, normalize_worker_url
from pdserve.router.policies import PoolRole
from pdserve.router.pool import DuplicateWorkerError
from pdserve.router.runtime import Discover, RouterRuntime
from pdserve.router.tokenizer import PromptTokenizer

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


class WorkerToAdd(BaseModel):
    """``POST /workers``'s body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    url: str
    role: Literal["prefill", "decode"]


def build_app(
    config: RouterConfig,
    tokenizer: PromptTokenizer | None = None,
    discover: Discover | None = None,
) -> FastAPI:
    """The app; its lifespan starts and stops the `RouterRuntime` (``app.state.runtime``).
    `tokenizer` None: prompts are tokenized by a worker's ``POST /tokenize``; `discover`:
    the workers of a provisioner (a cluster) besides the configured ones."""
    runtime = RouterRuntime(config, tokenizer, discover)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.runtime = runtime
    install_front_door(
        app,
        api_key=config.api_key,
        protected_prefixes=("/v1/", "/workers"),
        max_body_bytes=config.max_body_bytes,
    )
    _add_openai_routes(app, runtime)
    _add_worker_routes(app, runtime)
    return app


def _add_openai_routes(app: FastAPI, runtime: RouterRuntime) -> None:
    # `_body: RoutedRequest` makes FastAPI parse and check the body as a worker's app does (same
    # errors); the dispatcher relays the parsed JSON itself, which Starlette keeps.
    @app.post(COMPLETIONS, responses=ERROR_RESPONSES)
    async def completions(_body: RoutedRequest, request: Request) -> Response:
        return await runtime.dispatcher.handle(request, COMPLETIONS, await request.json())

    @app.post(CHAT_COMPLETIONS, responses=ERROR_RESPONSES)
    async def chat_completions(_body: RoutedRequest, request: Request) -> Response:
        return await runtime.dispatcher.handle(request, CHAT_COMPLETIONS, await request.json())

    @app.get("/v1/models")
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
    raise APIError(ErrorType.UNAVAILABLE, "no healthy worker", code="no_worker")


def _add_worker_routes(app: FastAPI, runtime: RouterRuntime) -> None:
    registry = runtime.registry

    @app.get("/workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse({"workers": [w.to_dict() for w in registry.all_workers()]})

    @app.post("/workers", responses=ERROR_RESPONSES)
    async def add_worker(body: WorkerToAdd) -> JSONResponse:
        """The worker is health-checked at once and joins rotation when that passes (201
        either way). A router holding a fleet secret presents it to the worker, so only an
        operator with the router's API key may add one."""
        if runtime.config.fleet_secret is not None and runtime.config.api_key is None:
            raise APIError(
                ErrorType.PERMISSION,
                "this deployment's workers share a fleet secret the router would present to "
                "any URL added here: start the router with --api-key to add workers by URL",
                param="url",
            )
        try:
            worker = registry.add(normalize_worker_url(body.url, "url"), PoolRole(body.role))
        except DuplicateWorkerError as exc:
            raise APIError(ErrorType.CONFLICT, str(exc), param="url") from exc
        except ValueError as exc:
            raise invalid("url", str(exc)) from exc
        await runtime.health.check(worker)
        return JSONResponse(worker.to_dict(), status_code=201)

    @app.delete("/workers/{worker_id}", responses=ERROR_RESPONSES)
    async def drain_worker(worker_id: str) -> JSONResponse:
        """Stop routing to the worker; it is removed once its in-flight requests finish.
        200 with ``removed: true`` when that is already so, 202 while it drains."""
        worker = registry.drain(worker_id)
        if worker is None:
            raise APIError(
                ErrorType.NOT_FOUND, f"no worker with id {worker_id!r}", param="worker_id"
            )
        is_removed = not registry.is_registered(worker)
        return JSONResponse(
            {**worker.to_dict(), "removed": is_removed}, status_code=200 if is_removed else 202
        )
