"""The router's Prometheus metrics (`pdserve:router_*`, and the autoscaler's
`pdserve:pool_workers` and `pdserve:scaling_decisions_total`), in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from pdserve.router.autoscale.planner import Decision
from pdserve.router.policies import PoolRole
from pdserve.router.pool import Worker, WorkerState
from pdserve.router.timing import RequestTiming

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_BYTES_BUCKETS = tuple(float(1 << p) for p in range(10, 34, 2))  # 1 KiB .. 8 GiB


class _WorkerCollector:
    """Per-worker gauges computed at scrape time from the live registry (no stale labels
    after a worker is removed)."""

    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self._workers = workers

    def collect(self) -> Iterable[Metric]:
        labels = ["worker", "role", "url"]
        up = GaugeMetricFamily(
            "pdserve:router_worker_up",
            "1 when the worker is in rotation (healthy, not draining)",
            labels=labels,
        )
        inflight = GaugeMetricFamily(
            "pdserve:router_worker_inflight_requests",
            "Requests the router has in flight on the worker",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pdserve:router_worker_healthy",
            "1 when the worker's last health check passed",
            labels=labels,
        )
        indexed = GaugeMetricFamily(
            "pdserve:router_worker_indexed_blocks",
            "Block hashes the worker's KV events say its prefix cache holds",
            labels=labels,
        )
        pool_workers = GaugeMetricFamily(
            "pdserve:pool_workers",
            "Workers in each pool, not draining (in rotation or about to be)",
            labels=["role"],
        )
        num_in_pool = dict.fromkeys(PoolRole, 0)
        for w in self._workers():
            values = [w.worker_id, w.role.value, w.url]
            up.add_metric(values, float(w.is_routable))
            inflight.add_metric(values, float(w.num_inflight))
            healthy.add_metric(values, float(w.state is WorkerState.HEALTHY))
            indexed.add_metric(values, float(w.num_indexed_blocks))
            num_in_pool[w.role] += not w.is_draining
        for role, count in num_in_pool.items():
            pool_workers.add_metric([role.value], float(count))
        return [up, inflight, healthy, indexed, pool_workers]


class RouterMetrics:
    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.queue = seconds(
            "pdserve:router_queue_seconds", "Arrival to first leg sent (tokenize + select)"
        )
        self.prefill_leg = seconds(
            "pdserve:router_prefill_leg_seconds", "Prefill leg round trip, retries included"
        )
        self.kv_transfer = seconds(
            "pdserve:router_kv_transfer_seconds", "KV fetch time reported by the decode worker"
        )
        self.kv_transfer_bytes = Histogram(
            "pdserve:router_kv_transfer_bytes",
            "KV bytes fetched by the decode worker",
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.first_decode_step = seconds(
            "pdserve:router_first_decode_step_seconds",
            "Decode worker's first step, as it reports it",
        )
        self.ttft = seconds(
            "pdserve:router_time_to_first_token_seconds",
            "Arrival to the decode worker's first body byte",
        )
        self.e2e = seconds(
            "pdserve:router_e2e_request_latency_seconds", "Arrival to the end of the response"
        )
        self.requests = Counter(
            "pdserve:router_requests", "Requests finished, by route", ["route"], registry=r
        )
        self.errors = Counter(
            "pdserve:router_request_errors", "Failed requests, by type", ["type"], registry=r
        )
        self.prefill_retries = Counter(
            "pdserve:router_prefill_retries", "Prefill legs retried on another worker", registry=r
        )
        self.predicted_hit_tokens = Counter(
            "pdserve:router_predicted_hit_tokens",
            "Prompt tokens the prefix index said the computing worker had cached",
            registry=r,
        )
        self.hit_tokens = Counter(
            "pdserve:router_hit_tokens",
            "Prompt tokens the computing worker found cached (its own cache and the store), "
            "for the same requests",
            registry=r,
        )
        self.scaling_decisions = Counter(
            "pdserve:scaling_decisions",
            "Autoscaler changes: the pool that gains (up, switch) or loses (down) a worker, "
            "and the signal that decided it",
            ["role", "direction", "reason"],
            registry=r,
        )
        r.register(_WorkerCollector(workers))

    def observe(self, timing: RequestTiming) -> None:
        """Record a finished request's breakdown."""
        if timing.route is not None:
            self.requests.labels(timing.route.value).inc()
        for histogram, value_ms in (
            (self.queue, timing.router_queue_ms),
            (self.prefill_leg, timing.prefill_ms),
            (self.ttft, timing.ttft_ms),
            (self.e2e, timing.e2e_ms),
        ):
            if value_ms is not None:
                histogram.observe(value_ms / 1e3)
        if timing.predicted_hit_tokens is not None and timing.hit_tokens is not None:
            self.predicted_hit_tokens.inc(timing.predicted_hit_tokens)
            self.hit_tokens.inc(timing.hit_tokens)
        reported = timing.worker
        for histogram, key, scale in (
            (self.kv_transfer, "kv_transfer_ms", 1e-3),
            (self.kv_transfer_bytes, "kv_transfer_bytes", 1.0),
            (self.first_decode_step, "first_decode_step_ms", 1e-3),
        ):
            value = reported.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                histogram.observe(value * scale)

    def count_decision(self, decision: Decision) -> None:
        self.scaling_decisions.labels(
            decision.role.value, decision.direction, decision.reason
        ).inc()

    def count_error(self, error_type: str) -> None:
        self.errors.labels(error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
