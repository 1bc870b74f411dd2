"""The router's FastAPI app: a worker's OpenAI surface plus /workers, /health, /metrics.

The front door is the server's (`pdserve.api`): the same error envelope, API key check, body
limit and request models, so the router refuses a bad body itself with the 400 a worker would
give, and publishes the same document for it. What needs the model (its name, context window,
vocabulary) only a worker knows: those answers are relayed. Runtime scaling: ``GET /workers``,
``POST /workers``, ``DELETE /workers/{id}`` (drain; a worker the launcher started is then
stopped), ``POST /workers/{id}/role`` (drain, switch prefill ⇄ decode in place, move pools)
and, with ``--autoscale``, ``GET /autoscale`` (the planner's decisions).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.asgi import install_front_door
from pdserve.api.errors import APIError, ErrorType, invalid
from pdserve.api.openapi import GENERATION_ERRORS, answers, generation_route, json_answer
from pdserve.api.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    RoleChange,
)
from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.config import RouterConfig, normalize_worker_url
from pdserve.router.policies import PoolRole
from pdserve.router.pool import DuplicateWorkerError, Worker, WorkerRegistry
from pdserve.router.runtime import Discover, RouterRuntime
from pdserve.router.tokenizer import PromptTokenizer

# What `normalize_worker_url` takes: http(s)://host[:port][/], a port in 0-65535.
_PORT = r"0*(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
WORKER_URL_PATTERN = rf"^https?://[A-Za-z0-9.-]+(?::(?:{_PORT})?)?/?$"

# Besides the worker's answers, relayed: no decode worker could take the request.
_GENERATION_ERRORS = (*GENERATION_ERRORS, ErrorType.BAD_GATEWAY)

if TYPE_CHECKING:
    from pdserve.router.provision import Provisioner


class WorkerToAdd(BaseModel):
    """``POST /workers``'s body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    url: str = Field(pattern=WORKER_URL_PATTERN, description="http://host:port")
    role: Literal["prefill", "decode"]


class WorkerRecord(BaseModel):
    """One worker as ``GET /workers`` lists it (`pool.Worker.to_dict`)."""

    id: str
    url: str
    role: Literal["prefill", "decode"]
    node_id: str | None = Field(description="its node, where a provisioner (a cluster) knows it")
    state: Literal["unknown", "healthy", "unhealthy"]
    draining: bool
    switching: bool = Field(description="draining to switch role in place")
    num_inflight: int
    num_inflight_prefill_tokens: int
    num_running: int | None
    num_waiting: int | None
    kv_cache_usage: float | None
    num_indexed_blocks: int = Field(
        description="block hashes the worker's KV events say it caches (0 when prefix routing "
        "is off: the router then does not subscribe)"
    )
    last_error: str | None


class DrainedWorker(WorkerRecord):
    removed: bool = Field(description="false while its in-flight requests finish")


class WorkerList(BaseModel):
    workers: list[WorkerRecord]


class RoleMoved(BaseModel):
    """``POST /workers/{id}/role``: the worker's new record and where the time went."""

    worker: WorkerRecord
    previous_id: str
    router_drain_s: float = Field(description="until the router had nothing in flight on it")
    worker_drain_s: float | None = Field(description="until its engine was empty")
    switch_s: float | None
    total_s: float


class AutoscaleState(BaseModel):
    """``GET /autoscale`` (`Autoscaler.to_dict`)."""

    config: dict[str, Any]
    decisions: list[dict[str, Any]]
    outcomes: list[dict[str, Any]]
    last_tick: dict[str, Any] | None
    busy: bool
    uptime_s: float


class PoolHealth(BaseModel):
    routable: int
    total: int


class RouterHealth(BaseModel):
    status: Literal["ok", "unavailable"]
    prefill: PoolHealth
    decode: PoolHealth


def build_app(
    config: RouterConfig,
    tokenizer: PromptTokenizer | None = None,
    provisioner: Provisioner | None = None,
    autoscale: AutoscaleConfig | None = None,
    discover: Discover | None = None,
) -> FastAPI:
    """The app; its lifespan starts and stops the `RouterRuntime` (``app.state.runtime``).
    `tokenizer` None: prompts are tokenized by a worker's ``POST /tokenize``; `provisioner`,
    `autoscale` and `discover` (a cluster's workers) as `RouterRuntime` takes them."""
    runtime = RouterRuntime(config, tokenizer, provisioner, autoscale, discover)

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
        protected_prefixes=("/v1/", "/workers", "/autoscale"),
        max_body_bytes=config.max_body_bytes,
    )
    _add_openai_routes(app, runtime)
    _add_worker_routes(app, runtime)
    return app


def _add_openai_routes(app: FastAPI, runtime: RouterRuntime) -> None:
    # `_body` makes FastAPI check the body with the worker's own model (same 400s); the
    # dispatcher relays the client's JSON itself (unknown fields too), which Starlette keeps.
    @app.post(**generation_route(COMPLETIONS, *_GENERATION_ERRORS))
    async def completions(_body: CompletionRequest, request: Request) -> Response:
        return await runtime.dispatcher.handle(request, COMPLETIONS, await request.json())

    @app.post(**generation_route(CHAT_COMPLETIONS, *_GENERATION_ERRORS))
    async def chat_completions(_body: ChatCompletionRequest, request: Request) -> Response:
        return await runtime.dispatcher.handle(request, CHAT_COMPLETIONS, await request.json())

    @app.get(
        "/v1/models",
        response_model=None,
        responses=answers(
            {200: json_answer(ModelList, "a worker's /v1/models")}, ErrorType.UNAVAILABLE
        ),
    )
    async def models() -> Response:
        return await _proxy_models(runtime)

    @app.get(
        "/health",
        response_model=None,
        responses=answers(
            {
                200: json_answer(RouterHealth, "a decode worker is in rotation"),
                503: json_answer(RouterHealth, "no decode worker is in rotation"),
            }
        ),
    )
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

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text exposition."""
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

    @app.get(
        "/workers",
        response_model=None,
        responses=answers({200: json_answer(WorkerList, "both pools' workers")}),
    )
    async def list_workers() -> JSONResponse:
        return JSONResponse({"workers": [w.to_dict() for w in registry.all_workers()]})

    @app.post(
        "/workers",
        status_code=201,
        response_model=None,
        responses=answers(
            {201: json_answer(WorkerRecord, "registered; in rotation once healthy")},
            ErrorType.CONFLICT,
            ErrorType.PERMISSION,
        ),
    )
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
            url = normalize_worker_url(body.url, "url")
            known = registry.by_url(url)
            if known is not None:  # a worker serves one pool
                raise DuplicateWorkerError(
                    f"url: {url} is registered already, as {known.role.value} worker "
                    f"{known.worker_id}"
                )
            worker = registry.add(url, PoolRole(body.role))
        except DuplicateWorkerError as exc:
            raise APIError(ErrorType.CONFLICT, str(exc), param="url") from exc
        except ValueError as exc:
            raise invalid("url", str(exc)) from exc
        await runtime.health.check(worker)
        return JSONResponse(worker.to_dict(), status_code=201)

    @app.delete(
        "/workers/{worker_id}",
        response_model=None,
        responses=answers(
            {
                200: json_answer(DrainedWorker, "removed"),
                202: json_answer(DrainedWorker, "draining: removed once its requests finish"),
            },
            ErrorType.NOT_FOUND,
        ),
    )
    async def drain_worker(worker_id: str) -> JSONResponse:
        """Stop routing to the worker; it is removed once its in-flight requests finish (and,
        when the launcher started it, stopped once its engine is empty). 200 with
        ``removed: true`` when that is already so, 202 while it drains."""
        worker = _worker(registry, worker_id)
        is_stopped_after = runtime.actions.owns(worker) and not worker.is_draining
        registry.drain(worker_id)
        if is_stopped_after:
            runtime.in_background(runtime.actions.remove(worker))
        is_removed = not registry.is_registered(worker)
        return JSONResponse(
            {**worker.to_dict(), "removed": is_removed}, status_code=200 if is_removed else 202
        )

    @app.post(
        "/workers/{worker_id}/role",
        response_model=None,
        responses=answers(
            {200: json_answer(RoleMoved, "switched and moved to the other pool")},
            ErrorType.NOT_FOUND,
            ErrorType.CONFLICT,
            ErrorType.BAD_GATEWAY,
        ),
    )
    async def switch_role(worker_id: str, body: RoleChange) -> JSONResponse:
        """Move the worker to the other pool without restarting it: stop routing to it, wait
        for its in-flight requests (and the KV it leases) to finish, have it switch
        (``POST /role`` on the worker), then route to it as a worker of `role`, under a new
        id. Answers the new record and the seconds each stage took; 409 when the switch is
        not possible (same role, not healthy, the last decode worker, still busy after
        `timeout_s`)."""
        worker = _worker(registry, worker_id)
        result = await runtime.actions.switch(worker, PoolRole(body.role), body.timeout_s)
        return JSONResponse(result)

    @app.get(
        "/autoscale",
        response_model=None,
        responses=answers(
            {200: json_answer(AutoscaleState, "the autoscaler's state")}, ErrorType.NOT_FOUND
        ),
    )
    async def autoscale_state() -> JSONResponse:
        """The planner's config, every decision with its reason, and the latest signals."""
        if runtime.autoscaler is None:
            raise APIError(ErrorType.NOT_FOUND, "autoscaling is off (start with --autoscale)")
        return JSONResponse(runtime.autoscaler.to_dict())


def _worker(registry: WorkerRegistry, worker_id: str) -> Worker:
    worker = registry.get(worker_id)
    if worker is None:
        raise APIError(ErrorType.NOT_FOUND, f"no worker with id {worker_id!r}", param="worker_id")
    return worker
