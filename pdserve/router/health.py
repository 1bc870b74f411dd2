"""Health checks and the circuit breaker.

Every `health_interval_s` each registered worker gets ``GET /health``. A worker leaves
rotation after `unhealthy_threshold` consecutive failures, or at once when a request to it
breaks at the connection level (`report_failure`); a single passing check puts it back. A
healthy worker's load gauges are scraped from its /metrics in the same round when its pool's
policy uses them.

Only three gauges matter to routing, so the scrape scans lines for their names instead of
parsing the whole exposition (a worker's /metrics holds many histograms; this runs every few
seconds per worker on the same cores the workers use). Samples of one gauge with different
labels are summed; so are the buckets of one histogram (`parse_histogram`, the autoscaler's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Collection

import httpx

from pdserve.api.metric_names import KV_USAGE_GAUGE, RUNNING_GAUGE, WAITING_GAUGE
from pdserve.router.autoscale.histogram import Histogram
from pdserve.router.policies import PoolRole
from pdserve.router.pool import ScrapedLoad, Worker, WorkerRegistry, WorkerState

logger = logging.getLogger("pdserve.router")

# The worker gauges routing reads.
_GAUGES = (RUNNING_GAUGE, WAITING_GAUGE, KV_USAGE_GAUGE)


class HealthMonitor:
    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        unhealthy_threshold: int,
        scrape_roles: Collection[PoolRole] = (),
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_threshold = unhealthy_threshold
        self.scrape_roles = frozenset(scrape_roles)

    async def run(self, before_round: Callable[[], object] = lambda: None) -> None:
        """Check every worker, forever, one round per interval; `before_round` runs first
        (the runtime's discovery)."""
        while True:
            before_round()
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.all_workers()))

    async def check(self, worker: Worker) -> None:
        try:
            response = await self.client.get(f"{worker.url}/health", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            self._record_failure(worker, f"/health: {type(exc).__name__}: {exc}")
            return
        if response.status_code != 200:
            self._record_failure(worker, f"/health returned {response.status_code}")
            return
        self._mark_healthy(worker)
        if worker.role in self.scrape_roles:
            await self._scrape(worker)

    def report_failure(self, worker: Worker, reason: str) -> None:
        """A request to the worker failed at the connection level (or its provisioner saw it
        die): open its circuit now."""
        self._open(worker, reason)

    def _record_failure(self, worker: Worker, reason: str) -> None:
        worker.num_consecutive_failures += 1
        worker.last_error = reason
        if (
            worker.state is not WorkerState.HEALTHY
            or worker.num_consecutive_failures >= self.unhealthy_threshold
        ):
            self._open(worker, reason)

    def _open(self, worker: Worker, reason: str) -> None:
        worker.last_error = reason
        if worker.state is not WorkerState.UNHEALTHY:
            logger.warning(
                "worker %s (%s) out of rotation: %s", worker.worker_id, worker.url, reason
            )
        worker.state = WorkerState.UNHEALTHY

    def _mark_healthy(self, worker: Worker) -> None:
        if worker.state is not WorkerState.HEALTHY:
            logger.info("worker %s (%s) healthy, in rotation", worker.worker_id, worker.url)
        worker.state = WorkerState.HEALTHY
        worker.num_consecutive_failures = 0

    async def _scrape(self, worker: Worker) -> None:
        try:
            response = await self.client.get(f"{worker.url}/metrics", timeout=self.timeout_s)
        except httpx.HTTPError:
            return  # load stays as last scraped; health decides rotation
        if response.status_code == 200:
            worker.scraped = parse_worker_load(response.text)


def parse_worker_load(text: str) -> ScrapedLoad:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("pdserve:"):
            continue
        for name in _GAUGES:
            value = _sample_value(line, name)
            if value is not None:
                totals[name] = totals.get(name, 0.0) + value
                break
    running, waiting = totals.get(RUNNING_GAUGE), totals.get(WAITING_GAUGE)
    return ScrapedLoad(
        num_running=None if running is None else round(running),
        num_waiting=None if waiting is None else round(waiting),
        kv_cache_usage=totals.get(KV_USAGE_GAUGE),
    )


_LE_LABEL = re.compile(r'(?:^|,)\s*le="([^"]*)"')


def parse_histogram(text: str, name: str) -> Histogram:
    """Histogram `name`'s cumulative buckets (``name_bucket{...,le="X"} N``), label sets
    summed; empty when the worker does not export it."""
    prefix = f"{name}_bucket{{"
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, rest = line[len(prefix) :].partition("}")
        match = _LE_LABEL.search(labels)
        fields = rest.split()
        if match is None or not fields:
            continue
        try:
            bound, value = float(match.group(1)), float(fields[0])
        except ValueError:
            continue
        buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets or math.inf not in buckets:
        return Histogram()
    bounds = tuple(sorted(buckets))
    return Histogram(bounds, tuple(buckets[b] for b in bounds))


def parse_total(text: str, name: str) -> float:
    """Sample `name` (a counter, a histogram's ``_sum``) summed over its label sets; 0 when
    the worker does not export it."""
    total = 0.0
    for line in text.splitlines():
        value = _sample_value(line, name) if line.startswith(name) else None
        total += value or 0.0
    return total


def _sample_value(line: str, name: str) -> float | None:
    """The value of a sample line ``name{labels} value [timestamp]`` of metric `name`."""
    if not line.startswith(name):
        return None
    rest = line[len(name) :]
    if rest.startswith("{"):
        close = rest.rfind("}")
        if close < 0:
            return None
        rest = rest[close + 1 :]
    elif not rest.startswith(" "):
        return None  # a longer name sharing the prefix
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None
