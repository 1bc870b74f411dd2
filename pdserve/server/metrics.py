"""Prometheus metrics, named `pdserve:*` after vLLM's `vllm:*` so its dashboards translate.

Each app owns a `CollectorRegistry` (several servers may share a process in tests). Request
histograms and token counters are fed by `tracking.RequestTracker` on the event loop; the step
histogram by the engine thread (prometheus-client instruments are thread-safe); engine gauges
are read from the engine's latest stats snapshot at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.api.errors import ErrorType
from pdserve.api.metric_names import (
    ITL_HISTOGRAM,
    KV_USAGE_GAUGE,
    RUNNING_GAUGE,
    STEP_TIME_HISTOGRAM,
    TTFT_HISTOGRAM,
    WAITING_GAUGE,
)
from pdserve.core.request import FinishReason
from pdserve.core.scheduler import EngineStats

# Bucket edges in seconds: CPU decode steps are tens of ms, long CPU prefills seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
_STEP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

LABEL = "model_name"


class ServerMetrics:
    """The server's instruments, all labelled with the served model name."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, [LABEL], registry=self.registry, buckets=buckets).labels(
                model_name
            )

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, [LABEL], registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            TTFT_HISTOGRAM, "Arrival to first token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            ITL_HISTOGRAM,
            "Gap between consecutive tokens.",
            LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "pdserve:request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "pdserve:e2e_request_latency_seconds", "Arrival to the last output.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "pdserve:request_queue_time_seconds",
            "Arrival to first scheduled step.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "pdserve:request_prefill_time_seconds",
            "Forward-pass time spent on the prompt.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "pdserve:request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.kv_transfer_exposed = histogram(
            "pdserve:kv_transfer_exposed_seconds",
            "KV transfer from a prefill worker after its last step: on the TTFT's critical path.",
            LATENCY_BUCKETS,
        )
        self.kv_transfer_hidden = histogram(
            "pdserve:kv_transfer_hidden_seconds",
            "KV transfer from a prefill worker while it still computed (streamed hand-off).",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens_per_request = histogram(
            "pdserve:request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS
        )
        self.generation_tokens_per_request = histogram(
            "pdserve:request_generation_tokens",
            "Output tokens per finished request.",
            _TOKEN_BUCKETS,
        )
        self.step_time = histogram(
            STEP_TIME_HISTOGRAM, "Duration of one LLMEngine.step().", _STEP_BUCKETS
        )
        self.prompt_tokens = counter("pdserve:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("pdserve:generation_tokens", "Generated tokens.")
        self.kv_stream_kept_tokens = counter(
            "pdserve:kv_stream_kept_tokens",
            "Prompt tokens kept from KV streams that broke off (the rest computed here).",
        )
        self._success = Counter(
            "pdserve:request_success",
            "Finished requests by reason.",
            [LABEL, "finished_reason"],
            registry=self.registry,
        )
        self._errors = Counter(
            "pdserve:request_errors",
            "Error responses by error type.",
            [LABEL, "type"],
            registry=self.registry,
        )
        # Every label value exists from the start, so rate() and dashboards see zeros.
        for reason in FinishReason:
            self._success.labels(model_name, reason.value)
        for error_type in ErrorType:
            self._errors.labels(model_name, error_type.type_name)
        self.registry.register(_EngineCollector(model_name, stats))

    def count_success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def count_error(self, error_type: str) -> None:
        self._errors.labels(self.model_name, error_type).inc()


class _EngineCollector(Collector):
    """Engine gauges and counters from the engine thread's latest snapshot."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # names are only known when collecting; that is fine for a custom registry

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = (
            (RUNNING_GAUGE, "Requests in the running batch.", stats.num_running),
            (
                WAITING_GAUGE,
                "Requests waiting for their first step.",
                stats.num_waiting,
            ),
            (
                KV_USAGE_GAUGE,
                "Fraction of KV blocks in use (0-1).",
                stats.kv_cache_usage,
            ),
            (
                "pdserve:kv_cache_free_blocks",
                "KV blocks free (cached-but-unused count as free).",
                stats.num_free_blocks,
            ),
            ("pdserve:kv_cache_total_blocks", "KV blocks in the pool.", stats.num_total_blocks),
            (
                "pdserve:prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up.",
                stats.prefix_cache_hit_rate,
            ),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=[LABEL])
            family.add_metric([self._model_name], value)
            yield family
        counters = (
            (
                "pdserve:num_preemptions",
                "Requests preempted to free KV blocks.",
                stats.num_preemptions,
            ),
            ("pdserve:engine_steps", "Engine steps run.", stats.num_steps),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=[LABEL])
            family.add_metric([self._model_name], value)
            yield family
