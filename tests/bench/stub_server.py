"""A stub OpenAI-compatible server that streams tokens on a known schedule.

Run: `python -m tests.bench.stub_server --port P [--mode colocated|chunked|disagg] ...`.
Each request's prefill takes `--ttft-ms` (`--long-ttft-ms` for prompts of at least
`--long-prompt-words` words; with `--prefill-wps W`, `--ttft-ms` plus its words / W), then it
streams one token every `--itl-ms`. While a long prompt prefills, other streams stall until it
ends (`--stall`, the colocated preset) or run `--slowdown` times slower (the chunked preset).

The step-time law, for tests that need a server with a capacity: by default every request's
prefill starts when it arrives; with `--serial-prefill` prefills run one at a time in arrival
order, so the server sustains at most 1 / prefill-time requests per second and a request's
first token waits for those ahead of it. With `--batch-cost C` each token gap is `--itl-ms` ×
(1 + C × (streams decoding − 1)). `--speed S` divides every duration by S (a slower or faster
machine).

Engines, as `bench compare` lays modes out on N cores: `--data-parallel-size N` gives N
independent engines (a request's prefill goes to the one free first, its stream stays there:
it stalls or slows only behind that engine's long prefills); `--mode disagg` with
`--prefill-workers P --decode-workers D` prefills on P engines and streams on D others (the
least busy), which no prefill disturbs. One engine by default.

The usage chunk reports when each token was really sent (`stub_emit_times`,
time.perf_counter, comparable across processes on Linux) and a timing breakdown
(`pdserve_timing`), like pdserve's router does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "stub-model"
MAX_MODEL_LEN = 8192
MODE_PRESETS = {
    "colocated": {"stall": True, "slowdown": 1.0},
    "chunked": {"stall": False, "slowdown": 2.0},
    "disagg": {"stall": False, "slowdown": 1.0},
}


@dataclass(frozen=True)
class Schedule:
    ttft_s: float = 0.05
    itl_s: float = 0.02
    long_prompt_words: int = 1000
    long_ttft_s: float = 0.5
    stall: bool = False
    slowdown: float = 1.0
    prefill_wps: float | None = None
    is_serial_prefill: bool = False
    batch_cost: float = 0.0

    def prefill_s(self, num_words: int) -> float:
        if self.prefill_wps is not None:
            return self.ttft_s + num_words / self.prefill_wps
        return self.long_ttft_s if num_words >= self.long_prompt_words else self.ttft_s


class _Prefills:
    """Time windows (loop clock) during which a long prompt is prefilling."""

    def __init__(self) -> None:
        self.windows: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        self.windows.append((start, end))

    def covering(self, t: float) -> tuple[float, float] | None:
        return next((w for w in self.windows if w[0] <= t < w[1]), None)


class _Engine:
    """One engine's state: when its prefill queue frees up, how many streams decode, when
    its long prompts prefill."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.num_decoding = 0
        self.prefills = _Prefills()


def create_app(schedule: Schedule, num_prefill: int = 1, num_decode: int | None = None) -> FastAPI:
    """`num_prefill` engines; `num_decode` other engines that only stream (None: each
    request streams on the engine that prefilled it)."""
    app = FastAPI()
    prefill_engines = [_Engine() for _ in range(num_prefill)]
    decode_engines = None if num_decode is None else [_Engine() for _ in range(num_decode)]

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "max_model_len": MAX_MODEL_LEN}]}

    async def stream(request: Request, is_chat: bool) -> StreamingResponse | JSONResponse:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        body = await request.json()
        if body.get("model") != MODEL:
            error = {"message": f"model {body.get('model')!r} not found", "param": "model"}
            return JSONResponse({"error": error}, status_code=404)
        prompt = body["messages"][-1]["content"] if is_chat else body["prompt"]
        num_words = len(prompt.split())
        is_long = num_words >= schedule.long_prompt_words
        prefill = schedule.prefill_s(num_words)
        engine = min(prefill_engines, key=lambda e: e.free_at)
        start = max(arrived, engine.free_at) if schedule.is_serial_prefill else arrived
        engine.free_at = start + prefill
        if is_long:
            engine.prefills.add(start, start + prefill)
        if decode_engines is not None:
            engine = min(decode_engines, key=lambda e: e.num_decoding)
        timing = {"queue_ms": (start - arrived) * 1000.0, "prefill_ms": prefill * 1000.0}
        events = _events(body, is_chat, engine, start + prefill, is_long, timing)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(body, is_chat, engine, first_due, is_long, timing):
        loop = asyncio.get_running_loop()
        emitted: list[float] = []
        if is_chat:
            # A role-only preamble sent at once, as some servers do: not a token.
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        due = first_due
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(max(0.0, due - loop.time()))
                window = engine.prefills.covering(loop.time())
                if schedule.stall and not is_long and window is not None:
                    await asyncio.sleep(max(0.0, window[1] - loop.time()))
                    due = window[1]
                if i == 0:
                    engine.num_decoding += 1
                emitted.append(time.perf_counter())
                yield _sse({"choices": [_choice(is_chat, f" w{i}")]})
                slow = schedule.slowdown if engine.prefills.covering(due) is not None else 1.0
                batch = 1.0 + schedule.batch_cost * (engine.num_decoding - 1)
                due += schedule.itl_s * slow * batch
        finally:
            if emitted:
                engine.num_decoding -= 1
        yield _sse({"choices": [{**_choice(is_chat, ""), "finish_reason": "length"}]})
        n = body["max_tokens"]
        num_words = len((body["messages"][-1]["content"] if is_chat else body["prompt"]).split())
        usage = {
            "prompt_tokens": num_words,
            "completion_tokens": n,
            "total_tokens": num_words + n,
            "pdserve_timing": timing,
            "stub_emit_times": emitted,
        }
        yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await stream(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await stream(request, is_chat=True)

    return app


def _choice(is_chat: bool, text: str) -> dict:
    if is_chat:
        return {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return {"index": 0, "text": text, "finish_reason": None}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=sorted(MODE_PRESETS))
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--long-prompt-words", type=int, default=1000)
    parser.add_argument("--long-ttft-ms", type=float, default=500.0)
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--prefill-wps", type=float, help="prefill speed, words per second")
    parser.add_argument("--serial-prefill", action="store_true")
    parser.add_argument("--batch-cost", type=float, default=0.0)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    # pdserve's own flags (a mode's token budget, say) mean nothing to the stub.
    args, _ = parser.parse_known_args()
    preset = MODE_PRESETS.get(args.mode, {})
    seconds = 1000.0 * args.speed  # ms at speed 1 -> seconds at this speed
    schedule = Schedule(
        ttft_s=args.ttft_ms / seconds,
        itl_s=args.itl_ms / seconds,
        long_prompt_words=args.long_prompt_words,
        long_ttft_s=args.long_ttft_ms / seconds,
        stall=preset.get("stall", args.stall),
        slowdown=preset.get("slowdown", args.slowdown),
        prefill_wps=None if args.prefill_wps is None else args.prefill_wps * args.speed,
        is_serial_prefill=args.serial_prefill,
        batch_cost=args.batch_cost,
    )
    if args.mode == "disagg":
        app = create_app(schedule, args.prefill_workers, args.decode_workers)
    else:
        app = create_app(schedule, args.data_parallel_size)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
