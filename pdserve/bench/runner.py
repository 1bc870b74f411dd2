"""Drive requests at their arrival times against one server and collect records."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import EndpointConfig, fetch_models, send_request
from pdserve.bench.errors import BenchError
from pdserve.bench.records import RequestRecord
from pdserve.bench.workloads.base import BenchRequest


@dataclass(frozen=True)
class ServerInfo:
    """What `GET /v1/models` says: the model to request and its context, when reported."""

    model: str
    max_model_len: int | None


async def probe_server(http: httpx.AsyncClient, endpoint: EndpointConfig) -> ServerInfo:
    """Ask the server for its model (unless given) and context length."""
    models = await fetch_models(http, endpoint)
    name = endpoint.model or models[0].get("id")
    if not isinstance(name, str):
        raise BenchError(f"{endpoint.base_url}: /v1/models entry has no 'id'; pass --model")
    entry = next((m for m in models if m.get("id") == name), {})
    max_len = entry.get("max_model_len")
    return ServerInfo(name, max_len if isinstance(max_len, int) and max_len > 0 else None)


async def warm_up(
    http: httpx.AsyncClient,
    endpoint: EndpointConfig,
    model: str,
    requests: list[BenchRequest],
) -> None:
    """Send requests one by one, unmeasured; fail early and clearly if one fails."""
    for request in requests:
        record = RequestRecord(-1, "warmup", request.prompt_len, request.output_len, 0.0)
        await send_request(http, endpoint, model, request, record, time.perf_counter())
        if not record.success:
            raise BenchError(
                f"warm-up request to {endpoint.url(endpoint.endpoint)} failed: {record.error}"
            )


async def run_requests(
    http: httpx.AsyncClient,
    endpoint: EndpointConfig,
    model: str,
    requests: list[BenchRequest],
    arrivals: np.ndarray,
    max_concurrency: int | None = None,
    show_progress: bool = True,
    label: str = "",
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (seconds from now); return the records, in
    request order, and the perf_counter value their times are relative to.

    With `max_concurrency`, a request that arrives while that many are in flight waits for a
    slot; its send time, and so its latencies, start when it actually goes out.
    """
    records = [
        RequestRecord(i, r.kind, r.prompt_len, r.output_len, float(t))
        for i, (r, t) in enumerate(zip(requests, arrivals, strict=True))
    ]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(
        total=len(requests),
        desc=label or "requests",
        file=sys.stderr,
        disable=not show_progress,
        unit="req",
        leave=False,
    )

    async def one(i: int) -> None:
        if slots is None:
            await send_request(http, endpoint, model, requests[i], records[i], t0)
        else:
            async with slots:
                await send_request(http, endpoint, model, requests[i], records[i], t0)
        bar.update(1)

    t0 = time.perf_counter()
    tasks = []
    for i in np.argsort(arrivals, kind="stable"):
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(int(i))))
    try:
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    return records, t0
