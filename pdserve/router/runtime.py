"""A running router's parts: pools, HTTP client, health monitor, metrics, dispatcher, the fleet
changes (add, drain, switch) and, with autoscaling, the planner loop."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import httpx

from pdserve.router.autoscale import AutoscaleConfig
from pdserve.router.autoscaler import Autoscaler, FleetActions
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.health import HealthMonitor
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import PoolRole, RoundRobin, make_policy
from pdserve.router.pool import WorkerPool, WorkerRegistry
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.tokenizer import PromptTokenizer, RemoteTokenizer

if TYPE_CHECKING:
    from pdserve.launch.provision import Provisioner

# How long a drained worker's engine may take to empty (its leased KV fetched) before it is
# stopped or switched anyway: beyond the default KV lease timeout.
DRAIN_TIMEOUT_S = 60.0


def build_registry(config: RouterConfig) -> WorkerRegistry:
    """Both pools with their policies and the configured workers (not yet checked)."""
    pools = {}
    # With a shared KV store, one belief of what it holds for both pools (prefill workers
    # write, decode workers read).
    store = (
        PrefixIndex(config.block_size, config.prefix_index_blocks)
        if config.shared_kv_store
        else None
    )
    for role, policy in (
        (PoolRole.PREFILL, config.prefill_policy),
        (PoolRole.DECODE, config.decode_policy),
    ):
        pools[role] = WorkerPool(
            role,
            make_policy(policy, role, config.balance_factor),
            PrefixIndex(config.block_size, config.prefix_index_blocks, store),
        )
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
    ) -> None:
        """`tokenizer` None: prompts are tokenized by a worker's ``POST /tokenize``.
        `provisioner`: where new workers come from (None: only workers started elsewhere);
        `autoscale`: run the planner loop (it needs the provisioner to add workers)."""
        self.config = config
        self._tokenizer = tokenizer
        self._provisioner = provisioner
        self.autoscale_config = autoscale
        self.registry = build_registry(config)
        self.metrics = RouterMetrics(self.registry.all_workers)
        self._client: httpx.AsyncClient | None = None
        self._health: HealthMonitor | None = None
        self._dispatcher: Dispatcher | None = None
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
        await self._health.check_all()
        self._health_task = asyncio.create_task(self._health.run())
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

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        for task in [self._health_task, *self._tasks]:
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.aclose()
