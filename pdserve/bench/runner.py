"""Drive requests at their arrival times against one server and collect records."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import fetch_models, send_request
from pdserve.workload.base import BenchRequest
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.records import STOPPED_EARLY, RequestRecord


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


@contextmanager
def heap_frozen() -> Iterator[None]:
    """While timing a server, keeps the objects this process held before out of the garbage
    collector's reach: a full collection holds the GIL for as long as it scans, and the
    records charge that pause to the server (late sends, late reads). In a big process (a
    test session's) one collection of 4M objects took 0.7 s on Zen 5, the size of the delay
    that once put 3 of 12 first tokens past a 500 ms SLO in CI. What the run allocates is
    still collected; on exit the held objects return to the collector. A process that froze
    its own heap already (as `pdserve serve` does) keeps its freeze: nothing is frozen or
    thawed then."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def warm_up(
    http: httpx.AsyncClient,
    endpoint: EndpointConfig,
    model: str,
    requests: list[BenchRequest],
) -> list[RequestRecord]:
    """Send requests one by one, outside the measured run; fail early and clearly if one
    fails. Their records (each timed from its own send) show the server's unloaded pace."""
    records = []
    with heap_frozen():
        for request in requests:
            record = RequestRecord(-1, "warmup", request.prompt_len, request.output_len, 0.0)
            await send_request(http, endpoint, model, request, record, time.perf_counter())
            if not record.success:
                raise BenchError(
                    f"warm-up request to {endpoint.url(endpoint.endpoint)} failed: {record.error}"
                )
            records.append(record)
    return records


# How often a run with `stop_when` asks whether to stop.
_STOP_POLL_S = 0.1
# Asked during a run with its records and the time since its start: stop now?
StopWhen = Callable[[list[RequestRecord], float], bool]


async def run_requests(
    http: httpx.AsyncClient,
    endpoint: EndpointConfig,
    model: str,
    requests: list[BenchRequest],
    arrivals: np.ndarray,
    max_concurrency: int | None = None,
    show_progress: bool = True,
    label: str = "",
    stop_when: StopWhen | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (seconds from now); return the records, in
    request order, and the perf_counter value their times are relative to.

    With `max_concurrency`, a request that arrives while that many are in flight waits for a
    slot; its send time, and so its latencies, start when it actually goes out.
    `stop_when(records, now)` is asked every 0.1 s; once it says yes, requests in flight are
    cancelled (the server sees the clients leave) and those not sent are not: all of them end
    with the error STOPPED_EARLY.
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

    async def send_all() -> None:
        tasks = []
        try:
            for i in np.argsort(arrivals, kind="stable"):
                delay = t0 + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(int(i))))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    with heap_frozen():
        t0 = time.perf_counter()
        sender = asyncio.create_task(send_all())
        try:
            while not sender.done():
                await asyncio.wait([sender], timeout=_STOP_POLL_S)
                now = time.perf_counter() - t0
                if stop_when is not None and not sender.done() and stop_when(records, now):
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
                    _mark_stopped(records, time.perf_counter() - t0)
            if not sender.cancelled():
                sender.result()  # re-raises what went wrong while sending
        finally:
            sender.cancel()
            bar.close()
    return records, t0


def _mark_stopped(records: list[RequestRecord], now: float) -> None:
    for record in records:
        if record.end_time is None:
            record.error = STOPPED_EARLY
            if record.send_time is not None:
                record.end_time = now
