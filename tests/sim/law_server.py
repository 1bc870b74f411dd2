"""An OpenAI-compatible stub server whose steps take what a known cost model says.

Run: `python -m tests.sim.law_server --port P`. One engine loop batches like a chunked
server (every running stream decodes each step; waiting prompts fill the rest of a
`--max-num-batched-tokens` budget), and each step lasts `LAW.step_time(batch)`: pdserve's
cost model for Llama-3.1-8B on one A100 at the efficiency `TRUTH`. Requests are admitted
`TRUTH.request_overhead_s` after they arrive. A prompt's tokens are its words (the tests
synthesize prompts with a one-word-one-token tokenizer). Time runs on the law's schedule:
each step starts when the last was due to end (or, idle, when a request was due to be let
in), so the event loop's late wake-ups (a busy or slow machine) delay a token's delivery
but never add up into the steps after it: a client sees the law plus its HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import deque
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS

MODEL = "law-model"
MAX_MODEL_LEN = 4096
TRUTH = Efficiency(
    linear_compute=0.5,
    attention_compute=0.3,
    memory=0.35,
    step_overhead_s=0.008,
    per_seq_overhead_s=0.0002,
    request_overhead_s=0.012,
)
LAW = CostModel(MODELS["Llama-3.1-8B"], get_hardware("A100-80GB"), efficiency=TRUTH)


@dataclass
class _Stream:
    num_prompt: int
    num_output: int
    admitted: float = 0.0  # when the front end let it in: `request_overhead_s` after arrival
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_computed: int = 0
    num_emitted: int = 0


class _Engine:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.waiting: deque[_Stream] = deque()
        self.running: list[_Stream] = []
        self.wake = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if not (self.waiting or self.running):
                self.wake.clear()
                await self.wake.wait()
                # From the moment the front end let the request in, not from this late wake.
                due = max(due, self.waiting[0].admitted)
            batch, finishing = self._schedule()
            # Each step ends one law step after the last one was due to end, however late
            # the event loop woke for it: a wake-up's lateness (timer, SSE writes, a slower
            # machine) delays that step's tokens but never the steps after it, so the
            # gaps a client sees average to the law's.
            due += LAW.step_time(batch)
            await asyncio.sleep(due - loop.time())
            self._emit(finishing)

    def _schedule(self) -> tuple[list[SeqWork], list[tuple[_Stream, int]]]:
        """Decodes first, then prompt chunks within the budget; (stream, new tokens) pairs."""
        work = [(s, 1) for s in self.running]
        left = self.budget - len(work)
        for stream in self.waiting:
            if left <= 0:
                break
            chunk = min(left, stream.num_prompt - stream.num_computed)
            work.append((stream, chunk))
            left -= chunk
        batch = [SeqWork(n, s.num_computed, s.num_computed + n >= s.num_prompt) for s, n in work]
        return batch, work

    def _emit(self, work: list[tuple[_Stream, int]]) -> None:
        for stream, num_new in work:
            stream.num_computed += num_new
            if stream.num_computed < stream.num_prompt:
                continue
            if stream in self.waiting:
                self.waiting.remove(stream)
                self.running.append(stream)
            stream.tokens.put_nowait(stream.num_emitted)
            stream.num_emitted += 1
            if stream.num_emitted == stream.num_output:
                self.running.remove(stream)

    def submit(self, stream: _Stream) -> None:
        self.waiting.append(stream)
        self.wake.set()


def create_app(budget: int) -> FastAPI:
    engine = _Engine(budget)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "max_model_len": MAX_MODEL_LEN}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        loop = asyncio.get_running_loop()
        admitted = loop.time() + TRUTH.request_overhead_s
        stream = _Stream(len(body["prompt"].split()), int(body["max_tokens"]), admitted)
        await asyncio.sleep(admitted - loop.time())
        engine.submit(stream)
        return StreamingResponse(_events(stream), media_type="text/event-stream")

    return app


async def _events(stream: _Stream):
    for _ in range(stream.num_output):
        index = await stream.tokens.get()
        chunk = {"choices": [{"index": 0, "text": f" w{index}", "finish_reason": None}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    usage = {"prompt_tokens": stream.num_prompt, "completion_tokens": stream.num_output}
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    app = create_app(args.max_num_batched_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
