"""One benchmark against one server: plan the workload, run it at each rate, summarize."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import EndpointConfig, make_http_client
from pdserve.bench.errors import BenchError
from pdserve.bench.interference import InterferenceConfig, InterferenceReport, detect_interference
from pdserve.bench.metrics import BenchMetrics, compute_metrics
from pdserve.bench.prompts import PromptSynthesizer
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import ServerInfo, StopWhen, probe_server, run_requests, warm_up
from pdserve.bench.tokenizer import TokenizerLike, load_tokenizer
from pdserve.bench.workloads.base import BenchRequest, Workload, make_request
from pdserve.redaction import redact_url

# Independent random streams derived from the one --seed: what the requests say, when they
# arrive, the warm-up prompts, and (chosen by the caller) where a trace window starts.
CONTENT_STREAM = 0
ARRIVAL_STREAM = 1
TRACE_WINDOW_STREAM = 2
WARMUP_STREAM = 3
# Warm-up requests: short, and text of their own so that they seed no prefix-cache hits for
# the measured requests; long enough an answer that the last one's median gap is the
# server's unloaded step (the detector's reference for overload).
WARMUP_PROMPT_LEN = 32
WARMUP_OUTPUT_LEN = 16


def seeded_rng(seed: int, stream: int) -> np.random.Generator:
    """The random generator for one purpose (`*_STREAM`) of a run seeded with `seed`."""
    return np.random.default_rng([seed, stream])


@dataclass(frozen=True)
class BenchSpec:
    """Everything that defines a run except the tokenizer.

    `request_rates` holds one rate per run (a sweep when several); None means the workload's
    own default (its steady rate, or a trace's recorded pace), inf means all at once.
    `max_model_len` overrides what the server reports when capping request lengths.
    """

    endpoint: EndpointConfig
    workload: Workload
    seed: int = 0
    request_rates: tuple[float | None, ...] = (None,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    slos: Mapping[str, float] = field(default_factory=dict)
    interference: InterferenceConfig = field(default_factory=InterferenceConfig)
    max_model_len: int | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rates:
            raise BenchError("--request-rate: give at least one rate")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise BenchError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise BenchError(f"--max-model-len must be >= 2, got {self.max_model_len}")

    def describe(self) -> dict:
        """The run configuration, JSON-ready."""
        e = self.endpoint
        return {
            "base_url": redact_url(e.base_url),
            "endpoint": e.endpoint,
            "temperature": e.temperature,
            "workload": self.workload.describe(),
            "seed": self.seed,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "num_warmups": self.num_warmups,
            "goodput_slos_ms": dict(self.slos),
            "interference": asdict(self.interference),
            "max_model_len": self.max_model_len,
        }


@dataclass(frozen=True)
class WorkloadPlan:
    """The requests of a run, built once so that every rate and every server sees the same."""

    workload: Workload
    requests: tuple[BenchRequest, ...]
    seed: int
    max_model_len: int | None
    warmups: tuple[BenchRequest, ...] = ()

    def arrivals(self, request_rate: float | None, burstiness: float) -> np.ndarray:
        """Arrival times for one rate; the same for the same seed."""
        rng = seeded_rng(self.seed, ARRIVAL_STREAM)
        return self.workload.arrival_times(list(self.requests), request_rate, burstiness, rng)


def plan_workload(
    workload: Workload,
    tokenizer: TokenizerLike,
    seed: int,
    max_model_len: int | None,
    num_warmups: int = 0,
) -> WorkloadPlan:
    """Build a workload's requests (and `num_warmups` warm-up requests) from the tokenizer,
    reproducibly from `seed`."""
    synth = PromptSynthesizer(tokenizer)
    requests = workload.build(synth, seeded_rng(seed, CONTENT_STREAM), max_model_len)
    if not requests:
        raise BenchError(f"workload {workload.name!r} produced no requests")
    rng = seeded_rng(seed, WARMUP_STREAM)
    warmups = tuple(
        make_request(synth, rng, WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN, max_model_len, "warmup")
        for _ in range(num_warmups)
    )
    return WorkloadPlan(workload, tuple(requests), seed, max_model_len, warmups)


@dataclass
class BenchResult:
    """One run: its records (times in seconds since `t0`, a time.perf_counter value),
    metrics, and the detector's findings; `warmups` are the warm-up requests sent alone
    before it (each timed from its own send), the detector's unloaded reference."""

    label: str
    model: str
    spec: BenchSpec
    request_rate: float | None
    records: list[RequestRecord]
    t0: float
    metrics: BenchMetrics
    interference: InterferenceReport
    warmups: list[RequestRecord] = field(default_factory=list)


def summarize(
    label: str,
    model: str,
    spec: BenchSpec,
    request_rate: float | None,
    records: list[RequestRecord],
    t0: float,
    warmups: Sequence[RequestRecord] = (),
) -> BenchResult:
    """Compute a run's metrics and the detector's report from its records."""
    metrics = compute_metrics(records, spec.slos)
    report = detect_interference(records, spec.interference, warmups)
    return BenchResult(
        label, model, spec, request_rate, records, t0, metrics, report, list(warmups)
    )


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
