"""The OpenAI-compatible FastAPI app over an `AsyncLLMEngine`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, GET /v1/models,
GET /health, GET /metrics, GET /kv/events and /kv/blocks (`server.kv_events`), and on a
disaggregated worker POST /role (switch pools in place).
`create_app()` wires one engine thread, one metrics registry and the front door
(`pdserve.api`: errors, API key, body limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from pdserve.api.asgi import install_front_door
from pdserve.api.errors import APIError, ErrorType
from pdserve.api.openapi import GENERATION_ERRORS, answers, generation_route, json_answer
from pdserve.api.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    RoleChange,
    RoleSwitched,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.core.kv_events import KVEventLog
from pdserve.engine.args import ROLE_TO_KV_ROLE
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.kv_store.connector import KVStoreConnector
from pdserve.server.inputs import (
    ModelInfo,
    PreparedRequest,
    prepare_chat,
    prepare_completion,
    tokenize,
)
from pdserve.server.kv_events import KVEventStreams, add_kv_event_routes
from pdserve.server.metrics import ServerMetrics
from pdserve.server.responses import ChatResponses, CompletionResponses, Responses, TokenTexts
from pdserve.server.serving import ServerState, new_request_id, serve
from pdserve.server.settings import ServerSettings

logger = logging.getLogger("pdserve.server.access")


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


def create_app(llm_engine, settings: ServerSettings) -> FastAPI:
    """Build the app over a (not yet started) synchronous `LLMEngine`; the engine thread
    starts with the app's lifespan and stops with it."""
    metrics = ServerMetrics(settings.served_model_names[0], stats=lambda: engine.stats)
    llm_engine.step_observers.append(lambda record: metrics.step_time.observe(record.step_s))
    for collector in llm_engine.kv_connector.metrics_collectors():
        metrics.registry.register(collector)
    block_manager = llm_engine.scheduler.block_manager
    kv_events = KVEventStreams(KVEventLog())
    block_manager.cache_observer = kv_events.log
    for connector in llm_engine.kv_connector.connectors:
        if isinstance(connector, KVStoreConnector):
            connector.store.observer = kv_events.log.store_observer()
    engine = AsyncLLMEngine(
        llm_engine, max_queue=settings.max_queue, burst_gap_s=settings.burst_gap_s
    )
    model = ModelInfo(
        settings.served_model_names,
        llm_engine.tokenizer,
        llm_engine.max_model_len,
        llm_engine.model_config.vocab_size,
    )
    state = ServerState(engine, model, metrics, TokenTexts(llm_engine.tokenizer), settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown(grace_s=0.0)

    app = FastAPI(title="pdserve", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.pdserve = state

    def on_error(error: APIError, path: str) -> None:
        metrics.count_error(error.error_type.type_name)
        logger.info(
            "- %s status=%d type=%s param=%s: %s",
            path,
            error.error_type.status_code,
            error.error_type.type_name,
            error.param,
            error.message,
        )

    install_front_door(
        app,
        api_key=settings.api_key,
        protected_prefixes=("/v1/", "/role", "/kv/"),
        max_body_bytes=settings.max_body_bytes,
        on_error=on_error,
        fleet_secret=settings.fleet_secret,
    )
    _add_routes(app, state)
    add_kv_event_routes(app, kv_events, block_manager.cached_block_hashes)
    if llm_engine.config.kv_transfer is not None:  # a disaggregated worker (--role)
        _add_role_route(app, state, kv_events)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(**generation_route(COMPLETIONS, *GENERATION_ERRORS))
    async def completions(body: CompletionRequest, http_request: Request) -> Response:
        return await _generate(http_request, state, body, prepare_completion, CompletionResponses)

    @app.post(**generation_route(CHAT_COMPLETIONS, *GENERATION_ERRORS))
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
        return await _generate(http_request, state, body, prepare_chat, ChatResponses)

    @app.post(
        "/tokenize",
        response_model=None,
        responses=answers(
            {200: json_answer(TokenizeResponse, "the prompt's token ids")}, ErrorType.NOT_FOUND
        ),
    )
    async def tokenize_route(body: TokenizeRequest) -> dict:
        """The prompt token ids a generation request would compute (see `inputs.tokenize`)."""
        return await asyncio.to_thread(tokenize, body, state.model)

    @app.get(
        "/v1/models",
        response_model=None,
        responses=answers({200: json_answer(ModelList, "the served model and its aliases")}),
    )
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "root": state.model.name,
                    "max_model_len": state.model.max_model_len,
                }
                for name in state.model.served_model_names
            ],
        }

    @app.get(
        "/health",
        response_model=None,
        responses=answers(
            {
                200: json_answer(Health, "the engine is making progress"),
                503: json_answer(Health, "the engine loop stalled or stopped"),
            }
        ),
    )
    async def health() -> JSONResponse:
        if state.engine.is_healthy(state.settings.health_timeout_s):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_role_route(app: FastAPI, state: ServerState, kv_events: KVEventStreams) -> None:
    @app.post(
        "/role",
        response_model=None,
        responses=answers({200: json_answer(RoleSwitched, "switched")}, ErrorType.CONFLICT),
    )
    async def switch_role(body: RoleChange) -> dict:
        """Serve as a prefill or a decode worker from now on, without reloading anything:
        once the requests and KV transfers in flight are done (requests arriving meanwhile
        wait, then run in the new role), the KV connector changes sides. The router stops
        routing here first (``POST /workers/{id}/role``). Answers the seconds spent waiting
        for the engine to empty (`drain_s`) and switching (`switch_s`)."""
        switched = await _switch_role(state.engine, body)
        kv_events.resync_all()  # subscribers re-check against a snapshot
        return switched


_ROLE_NAMES = {kv_role: name for name, kv_role in ROLE_TO_KV_ROLE.items() if kv_role}


async def _switch_role(engine: AsyncLLMEngine, body: RoleChange) -> dict:
    def switch(llm_engine) -> tuple[str, float]:
        started = time.perf_counter()
        previous = llm_engine.switch_kv_role(ROLE_TO_KV_ROLE[body.role])
        return _ROLE_NAMES[previous], time.perf_counter() - started

    try:
        (previous, switch_s), drain_s = await engine.run_when_idle(switch, body.timeout_s)
    except (TimeoutError, RuntimeError) as exc:
        raise APIError(ErrorType.CONFLICT, f"role switch refused: {exc}", code="busy") from exc
    logger.info(
        "- /role %s -> %s: drained %.3f s, switched %.3f s", previous, body.role, drain_s, switch_s
    )
    return {"role": body.role, "previous_role": previous, "drain_s": drain_s, "switch_s": switch_s}


async def _generate(
    http_request: Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prepare: Callable[..., PreparedRequest],
    renderer: type[Responses],
) -> Response:
    arrival_time = time.monotonic()
    # Off the event loop: a long prompt takes the tokenizer 100+ ms.
    prepared = await asyncio.to_thread(prepare, body, state.model)
    responses = renderer(
        new_request_id(http_request, renderer.id_prefix),
        body.model or state.model.name,
        state.token_texts,
        body.include_usage,
        body.router_timing,
    )
    return await serve(
        http_request,
        state,
        prepared,
        responses,
        stream=bool(body.stream),
        arrival_time=arrival_time,
    )
