"""One benchmark run as data: its spec (`BenchSpec`), its requests built once from a seed
(`WorkloadPlan`, `plan_workload`), and its result (`BenchResult`, `summarize`: metrics and the
interference detector's findings from the records). The load generator (`pdserve.bench`)
fills it over HTTP, the simulator (`pdserve.sim`) on a simulated clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pdserve.redaction import redact_url
from pdserve.workload.base import BenchRequest, Workload, make_request
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.interference import (
    InterferenceConfig,
    InterferenceReport,
    detect_interference,
)
from pdserve.workload.metrics import BenchMetrics, compute_metrics
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.records import RequestRecord
from pdserve.workload.tokenizer import TokenizerLike

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
