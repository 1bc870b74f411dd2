"""The store's Prometheus instruments, one set per worker (`pdserve:kv_store_*`).

`KVStoreMetrics` is a collector: a server exposes it by registering it in its own registry
(``registry.register(store.metrics)``). Instruments are thread-safe; the engine thread, the
fetch thread and the write-behind thread all count.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pdserve.kv_store.errors import ErrorKind

LABEL = "model_name"
# A fetch is one round trip for a request's run of blocks: sub-ms on loopback, 100s of ms
# for a long prompt over a slow link.
FETCH_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class KVStoreMetrics(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, [LABEL], registry=self._registry).labels(model_name)

        self.lookup_tokens = counter(
            "pdserve:kv_store_lookup_tokens", "Prompt tokens looked up in the KV store."
        )
        self.hit_tokens = counter(
            "pdserve:kv_store_hit_tokens", "Prompt tokens read from the KV store and used."
        )
        self.read_bytes = counter("pdserve:kv_store_read_bytes", "Bytes read from the KV store.")
        self.written_bytes = counter(
            "pdserve:kv_store_written_bytes", "Bytes written to the KV store."
        )
        self.dropped_writes = counter(
            "pdserve:kv_store_dropped_writes",
            "Blocks not written: the write queue was full or the store unavailable.",
        )
        self._errors = Counter(
            "pdserve:kv_store_errors",
            "Store failures and rejected values, by kind; each is a miss, not a failed request.",
            [LABEL, "kind"],
            registry=self._registry,
        )
        for kind in ErrorKind:  # every label value exists from the start
            self._errors.labels(model_name, kind.value)
        self.fetch_latency = Histogram(
            "pdserve:kv_store_fetch_seconds",
            "One fetch of a request's blocks from the KV store.",
            [LABEL],
            registry=self._registry,
            buckets=FETCH_BUCKETS,
        ).labels(model_name)

    def count_error(self, kind: ErrorKind, num: int = 1) -> None:
        self._errors.labels(self.model_name, kind.value).inc(num)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 if absent), e.g. ``value("pdserve:kv_store_errors_total",
        kind="corrupt")``."""
        found = self._registry.get_sample_value(name, {LABEL: self.model_name, **labels})
        return found or 0.0

    def describe(self) -> list[Metric]:
        return []  # let the registry that adopts this collect it instead

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()
