"""A running router's parts: pools, HTTP client, health monitor, metrics, dispatcher, the fleet
changes (add, drain, switch), the discovery that keeps the pools equal to a provisioner's
workers (a cluster's) and, with autoscaling, the planner loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import httpx

from pdserve.api.signing import FleetAuth
from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.autoscale.loop import Autoscaler, FleetActions
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.health import HealthMonitor
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import PoolRole, RoundRobin, make_policy
from pdserve.router.pool import Worker, WorkerPool, WorkerRegistry
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.provision import WorkerHandle
from pdserve.router.tokenizer import PromptTokenizer, RemoteTokenizer

if TYPE_CHECKING:
    from pdserve.router.provision import Provisioner

logger = logging.getLogger("pdserve.router")

# How long a drained worker's engine may take to empty (its leased KV fetched) before it is
# stopped or switched anyway: beyond the default KV lease timeout.
DRAIN_TIMEOUT_S = 60.0
# Discovery: the workers running now, as their provisioner knows them (`Provisioner.workers`).
Discover = Callable[[], Sequence[WorkerHandle]]


def build_registry(config: RouterConfig) -> WorkerRegistry:
    """Both pools with their policies and the configured workers (not yet checked)."""
    pools = {}
    # One index for both pools: a worker keeps its cache when it switches pools.
    index = PrefixIndex(config.block_size, config.shared_kv_store)
    for role, policy in (
        (PoolRole.PREFILL, config.prefill_policy),
        (PoolRole.DECODE, config.decode_policy),
    ):
        pools[role] = WorkerPool(role, make_policy(policy, role, config.balance_factor), index)
    registry = WorkerRegistry(pools[PoolRole.PREFILL], pools[PoolRole.DECODE])
    for url in config.prefill_urls:
        registry.add(url, PoolRole.PREFILL)
    for url in config.decode_urls:
        registry.add(url, PoolRole.DECODE)
    return registry


class RouterRuntime:
    """Built at app creation; `start` (in the event loop) opens the connection pool, runs the
    first health round and starts the periodic checks; `stop` undoes it."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PromptTokenizer | None = None,
        provisioner: Provisioner | None = None,
        autoscale: AutoscaleConfig | None = None,
        discover: Discover | None = None,
    ) -> None:
        """`tokenizer` None: prompts are tokenized by a worker's ``POST /tokenize``.
        `provisioner`: where new workers come from (None: only workers started elsewhere);
        `autoscale`: run the planner loop (it needs the provisioner to add workers);
        `discover`: where workers come from besides the configured URLs, read before every
        health round (`sync_discovered`)."""
        if not config.decode_urls and discover is None:
            raise ValueError("--decode: at least one decode worker URL is required")
        self.config = config
        self._tokenizer = tokenizer
        self._provisioner = provisioner
        self.autoscale_config = autoscale
        self._discover = discover
        # Provisioner name -> the URL of its worker, for those that came from `discover` (the
        # URL, not the record: a role switch moves a worker to a new record).
        self._discovered: dict[str, str] = {}
        self.registry = build_registry(config)
        self.metrics = RouterMetrics(self.registry.all_workers)
        self._client: httpx.AsyncClient | None = None
        self._health: HealthMonitor | None = None
        self._dispatcher: Dispatcher | None = None
        self.kv_events: KVEventSubscriber | None = None
        self._health_task: asyncio.Task | None = None
        self._actions: FleetActions | None = None
        self.autoscaler: Autoscaler | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "router not started"
        return self._client

    @property
    def health(self) -> HealthMonitor:
        assert self._health is not None, "router not started"
        return self._health

    @property
    def dispatcher(self) -> Dispatcher:
        assert self._dispatcher is not None, "router not started"
        return self._dispatcher

    @property
    def actions(self) -> FleetActions:
        assert self._actions is not None, "router not started"
        return self._actions

    def in_background(self, coroutine) -> None:
        """Run `coroutine` (a fleet change an HTTP answer does not wait for) until stop()."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        config = self.config
        self._client = httpx.AsyncClient(
            # Legs may run as long as they generate; only connecting is bounded.
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            # Idle connections are dropped before a worker's uvicorn drops them (after 5 s):
            # a leg sent on a connection the worker is closing fails as if the worker died.
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0
            ),
            trust_env=False,
            # Every leg, health check, scrape and fleet change is signed as the fleet's (the
            # secret itself never leaves; the client's own Authorization is never relayed).
            auth=FleetAuth(config.fleet_secret) if config.fleet_secret is not None else None,
            # --fleet-tls: the workers' HTTPS takes the router's certificate, and only theirs.
            verify=config.fleet_tls.client_context() if config.fleet_tls is not None else True,
        )
        scrape = [
            role
            for role, pool in self.registry.pools.items()
            if not isinstance(pool.policy, RoundRobin)
        ]
        self._health = HealthMonitor(
            self.registry,
            self._client,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            unhealthy_threshold=config.unhealthy_threshold,
            scrape_roles=scrape,
        )
        tokenizer = self._tokenizer or RemoteTokenizer(
            self.registry, self._client, config.health_timeout_s
        )
        self._dispatcher = Dispatcher(
            config, self.registry, self._client, self._health, self.metrics, tokenizer
        )
        self._actions = FleetActions(
            self.registry,
            self._client,
            self._health,
            self._provisioner,
            idle_timeout_s=DRAIN_TIMEOUT_S,
        )
        if config.needs_token_ids:  # routing reads the prefix index
            self.kv_events = KVEventSubscriber(
                self.registry.decode.prefix_index, self._client, config.connect_timeout_s
            )
        self.sync_workers()
        await self._health.check_all()
        self._health_task = asyncio.create_task(self._health.run(self.sync_workers))
        if self.autoscale_config is not None:
            self.autoscaler = Autoscaler(
                self.autoscale_config,
                self.registry,
                self._client,
                self._actions,
                self.metrics,
                scrape_timeout_s=config.health_timeout_s,
            )
            self.in_background(self.autoscaler.run())

    def sync_workers(self) -> None:
        """Before every health round: discovery, then follow the KV events of exactly the
        registered workers."""
        self.sync_discovered()
        if self.kv_events is not None:
            self.kv_events.sync(w.url for w in self.registry.all_workers())

    def sync_discovered(self) -> None:
        """Make the discovered part of the pools the provisioner's workers: a new one joins
        under its provisioner's name (in rotation once its first health check passes; one
        registered by URL already is adopted), one that is gone (its node or actor died, or
        it was stopped) leaves rotation now and the pool once its in-flight requests have
        ended (on a dead worker they fail and release it at once)."""
        if self._discover is None:
            return
        handles = {handle.name: handle for handle in self._discover()}
        for name in sorted(set(self._discovered) - set(handles)):
            worker = self.registry.by_url(self._discovered.pop(name))
            if worker is not None:
                self.health.report_failure(worker, "gone from its provisioner")
                self.registry.drain(worker.worker_id)
        for name in sorted(set(handles) - set(self._discovered)):
            self._discovered[name] = self._register(handles[name]).url

    def _register(self, handle: WorkerHandle) -> Worker:
        known = self.registry.by_url(handle.url)
        if known is not None:
            known.node_id = handle.node_id
            return known
        is_free = self.registry.get(handle.name) is None
        worker = self.registry.add(
            handle.url,
            PoolRole(handle.role),
            worker_id=handle.name if is_free else None,
            node_id=handle.node_id,
        )
        logger.info("discovered %s worker %s at %s", handle.role, worker.worker_id, handle.url)
        return worker

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        for task in [self._health_task, *self._tasks]:
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.aclose()
