"""A stand-in pdserve worker for router tests: speaks the hand-off, records what it receives.

Run as ``python -m tests.router.stub_worker --role prefill|decode --port P [--host H]
[--fail-status N]``.

- ``POST /v1/completions``, ``/v1/chat/completions``: a prefill stub answers one token and
  ``kv_transfer_params`` naming its (pretend) blocks; a decode stub generates ``max_tokens``
  tokens ``t0 t1 ...`` (SSE or JSON) and reports ``pdserve_timing`` echoing ``router_timing``.
  ``stub_prefill_hold: TAG`` in the body makes a prefill stub wait before answering, and
  ``stub_decode_hold: TAG`` a decode stub wait after its first token, until
  ``POST /stub/release/TAG``; a client leaving meanwhile is logged as ``disconnected``. A
  ``model`` other than "stub" is refused with a 404 naming the field (what only a worker can
  check: the router validates the rest itself).
- ``POST /tokenize``: one token per character (chat: role markers + contents).
- ``GET /health`` (``POST /stub/health {"ok": bool}`` flips it), ``GET /metrics`` (running
  requests gauge), ``GET /v1/models``, ``GET /stub/log`` (what happened, in order).
- ``GET /kv/events``, ``/kv/blocks``: the real routes (`server.kv_events`) over a pretend
  prefix cache that keeps every full block (16 tokens) of every prompt it served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pdserve.core.block_manager import extend_block_hashes
from pdserve.core.kv_events import KVEventLog
from pdserve.server.cli import inherited_sockets
from pdserve.server.kv_events import KVEventStreams, add_kv_event_routes

KV_BYTES_PER_TOKEN = 64
BLOCK_SIZE = 16


def build_stub(role: str, port: int, fail_status: int | None, host: str = "127.0.0.1") -> FastAPI:
    app = FastAPI()
    state: dict[str, Any] = {"healthy": True, "running": 0, "log": [], "holds": {}}
    streams = KVEventStreams(KVEventLog())
    cached: set[int] = set()
    add_kv_event_routes(app, streams, lambda: list(cached))

    def cache_prompt(body: dict[str, Any]) -> None:
        hashes = extend_block_hashes([], [ord(c) for c in _prompt_text(body)], BLOCK_SIZE)
        new = [h for h in hashes if h not in cached]
        cached.update(new)
        streams.log.blocks_stored(new)

    def log(event: str, body: dict[str, Any], request: Request, **extra) -> None:
        state["log"].append(
            {
                "event": event,
                "body": body,
                "port": port,
                "request_id": request.headers.get("x-request-id"),
                "authorization": request.headers.get("authorization"),
                **extra,
            }
        )

    def hold_event(tag: str) -> asyncio.Event:
        return state["holds"].setdefault(tag, asyncio.Event())

    async def wait_released(request: Request, tag: str) -> bool:
        """Wait for the release of `tag`; False if the client disconnected first."""
        released = asyncio.ensure_future(hold_event(tag).wait())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait((released, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
            gone.cancel()
        return released in done

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"ok": state["healthy"]}, status_code=200 if state["healthy"] else 503)

    @app.post("/stub/health")
    async def set_health(request: Request) -> Response:
        state["healthy"] = bool((await request.json())["ok"])
        return JSONResponse({"ok": state["healthy"]})

    @app.post("/stub/release/{tag}")
    async def release(tag: str) -> Response:
        hold_event(tag).set()
        return JSONResponse({"released": tag})

    @app.get("/stub/log")
    async def get_log() -> Response:
        return JSONResponse(state["log"])

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            "# TYPE pdserve:num_requests_running gauge\n"
            f'pdserve:num_requests_running{{model_name="stub"}} {state["running"]}\n'
            f'pdserve:num_requests_waiting{{model_name="stub"}} 0\n'
            f'pdserve:kv_cache_usage_perc{{model_name="stub"}} 0.25\n'
        )

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        text = (
            body.get("prompt")
            or "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
        )
        tokens = [ord(c) for c in text]
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    async def complete(request: Request, endpoint: str) -> Response:
        body = await request.json()
        log("received", body, request, endpoint=endpoint)
        if fail_status is not None:
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=fail_status)
        if body.get("model", "stub") != "stub":
            return JSONResponse(
                {
                    "error": {
                        "message": f"model {body['model']!r} does not exist",
                        "type": "not_found_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status_code=404,
            )
        cache_prompt(body)
        if role == "prefill":
            return await prefill(request, body)
        return await decode(request, body, endpoint)

    async def prefill(request: Request, body: dict[str, Any]) -> Response:
        tag = body.get("stub_prefill_hold")
        if tag and not await wait_released(request, tag):
            log("disconnected", body, request)
            return Response(status_code=499)
        num_tokens = len(_prompt_text(body))
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": f"stub-{port}",
            "remote_request_id": request.headers.get("x-request-id"),
            "remote_host": host,
            "remote_port": port,
            "remote_block_ids": list(range(1, num_tokens // 16 + 2)),
            "remote_num_tokens": num_tokens,
            "transport": "tcp",
            "layout_hash": "stub-layout",
            "protocol_version": 1,
        }
        log("prefilled", body, request)
        return JSONResponse(
            {
                "id": "cmpl-prefill",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "t0", "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": num_tokens,
                    "completion_tokens": 1,
                    "total_tokens": num_tokens + 1,
                },
                "kv_transfer_params": params,
            }
        )

    async def decode(request: Request, body: dict[str, Any], endpoint: str) -> Response:
        is_chat = endpoint.endswith("chat/completions")
        texts = [f"t{i} " for i in range(body.get("max_tokens", 4))]
        kv = body.get("kv_transfer_params") or {}
        timing = {
            **(body.get("router_timing") or {}),
            "kv_transfer_bytes": kv.get("remote_num_tokens", 0) * KV_BYTES_PER_TOKEN,
            "kv_transfer_ms": 1.5 if kv else 0.0,
            "first_decode_step_ms": 2.5,
        }
        usage = {
            "prompt_tokens": len(_prompt_text(body)),
            "completion_tokens": len(texts),
            "total_tokens": len(_prompt_text(body)) + len(texts),
        }
        if not body.get("stream"):
            log("completed", body, request)
            choice = (
                {"message": {"role": "assistant", "content": "".join(texts)}}
                if is_chat
                else {"text": "".join(texts)}
            )
            return JSONResponse(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "choices": [{"index": 0, "finish_reason": "length", **choice}],
                    "usage": usage,
                    "pdserve_timing": timing,
                }
            )

        async def events():
            state["running"] += 1
            try:
                for i, text in enumerate(texts):
                    delta = {"delta": {"content": text}} if is_chat else {"text": text}
                    yield _sse({"id": "cmpl-1", "choices": [{"index": 0, **delta}]})
                    tag = body.get("stub_decode_hold")
                    if i == 0 and tag and not await wait_released(request, tag):
                        log("disconnected", body, request)
                        return
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield _sse(
                        {"id": "cmpl-1", "choices": [], "usage": usage, "pdserve_timing": timing}
                    )
                yield b"data: [DONE]\n\n"
                log("completed", body, request)
            except asyncio.CancelledError:
                log("disconnected", body, request)
                raise
            finally:
                state["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, "/v1/chat/completions")

    return app


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
    return body.get("prompt", "")


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail-status", type=int, default=None)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    config = uvicorn.Config(
        build_stub(args.role, args.port, args.fail_status, args.host),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run(inherited_sockets())  # a WorkerGroup's worker: the port it holds


if __name__ == "__main__":
    main()
