"""One benchmark against one server: plan the workload, run it at each rate, summarize."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import replace

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import make_http_client
from pdserve.bench.runner import ServerInfo, StopWhen, probe_server, run_requests, warm_up
from pdserve.workload.records import RequestRecord
from pdserve.workload.run import BenchResult, BenchSpec, WorkloadPlan, plan_workload, summarize
from pdserve.workload.tokenizer import TokenizerLike, load_tokenizer


async def run_plan(
    spec: BenchSpec, plan: WorkloadPlan, server: ServerInfo, label: str = ""
) -> list[BenchResult]:
    """Run a planned workload once per rate of the spec against one server."""
    async with make_http_client(spec.endpoint) as http:
        warmups = await warm_up(http, spec.endpoint, server.model, list(plan.warmups))
        is_sweep = len(spec.request_rates) > 1
        return [
            await run_rate(
                http, spec, plan, server, rate, _run_label(label, plan, rate, is_sweep), warmups
            )
            for rate in spec.request_rates
        ]


async def run_rate(
    http: httpx.AsyncClient,
    spec: BenchSpec,
    plan: WorkloadPlan,
    server: ServerInfo,
    rate: float | None,
    label: str,
    warmups: Sequence[RequestRecord] = (),
    stop_when: StopWhen | None = None,
) -> BenchResult:
    """One run of the planned workload at `rate` (see `run_requests` for `stop_when`)."""
    phases = plan.workload.phases(list(plan.requests))
    if phases is None:
        records, t0 = await run_requests(
            http,
            spec.endpoint,
            server.model,
            list(plan.requests),
            plan.arrivals(rate, spec.burstiness),
            spec.max_concurrency,
            spec.show_progress,
            label,
            stop_when,
        )
    else:
        records, t0 = await _run_phases(http, spec, server.model, plan, phases, label)
    resolved = plan.workload.resolve_rate(rate)
    return summarize(label, server.model, spec, resolved, records, t0, warmups)


async def _run_phases(
    http, spec: BenchSpec, model: str, plan: WorkloadPlan, phases: list[list[int]], label: str
) -> tuple[list[RequestRecord], float]:
    """Each phase's requests sent together once the previous phase has finished; the records
    in request order, on one clock."""
    records: list[RequestRecord | None] = [None] * len(plan.requests)
    t0 = time.perf_counter()
    for phase in tqdm(phases, desc=label or "phases", disable=not spec.show_progress):
        requests = [plan.requests[i] for i in phase]
        phase_records, phase_t0 = await run_requests(
            http, spec.endpoint, model, requests, np.zeros(len(requests)), None, False
        )
        for i, record in zip(phase, phase_records, strict=True):
            records[i] = _shifted(record, i, phase_t0 - t0)
    return records, t0


def _shifted(record: RequestRecord, index: int, offset: float) -> RequestRecord:
    """`record` as request `index`, its times moved `offset` seconds later."""

    def later(t: float | None) -> float | None:
        return None if t is None else t + offset

    return replace(
        record,
        index=index,
        arrival_time=later(record.arrival_time),
        send_time=later(record.send_time),
        end_time=later(record.end_time),
        token_times=[t + offset for t in record.token_times],
    )


async def probe(spec: BenchSpec) -> ServerInfo:
    """Ask the spec's server which model it serves and its context length."""
    async with make_http_client(spec.endpoint) as http:
        return await probe_server(http, spec.endpoint)


def context_cap(spec: BenchSpec, server: ServerInfo) -> int | None:
    """The context length requests are fitted to: the spec's override, else the server's."""
    return spec.max_model_len or server.max_model_len


def run_benchmark(
    spec: BenchSpec, tokenizer: TokenizerLike | None = None, label: str = ""
) -> list[BenchResult]:
    """Probe the server, build the workload, and run it at each rate: one result per rate.

    `tokenizer` defaults to pdserve's default model's (loaded lazily).
    """
    server = asyncio.run(probe(spec))
    tokenizer = tokenizer or load_tokenizer(None)
    plan = plan_workload(
        spec.workload, tokenizer, spec.seed, context_cap(spec, server), spec.num_warmups
    )
    return asyncio.run(run_plan(spec, plan, server, label))


def _run_label(label: str, plan: WorkloadPlan, rate: float | None, is_sweep: bool) -> str:
    if not is_sweep:
        return label or "run"
    resolved = plan.workload.resolve_rate(rate)
    return rate_label(label, resolved)


def rate_label(label: str, rate: float | None) -> str:
    """A run's label within a sweep or a search: "NAME rate=R"."""
    rate_text = "trace" if rate is None else ("inf" if math.isinf(rate) else f"{rate:g}")
    return f"{label} rate={rate_text}".strip()
