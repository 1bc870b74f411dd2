"""The gateway's routing, on simulated workers: pdserve.router's pools, policies, leases and
prefix index, driven the way its dispatcher drives them.

Per request (as `pdserve.router.dispatch`): pick a decode worker; a prompt whose uncached
length there is below the local-prefill threshold (or any prompt when there is no prefill
pool) goes to it directly; otherwise a prefill worker runs the prefill leg first. Decode load
comes from the workers' metrics, scraped every `RouterConfig.health_interval_s`; in-flight
counts and pending prefill tokens are the router's own exact bookkeeping (leases).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.router.config import RouterConfig
from pdserve.router.policies import PoolRole, make_policy
from pdserve.router.pool import Lease, ScrapedLoad, Worker, WorkerPool, WorkerRegistry, WorkerState
from pdserve.router.prefix_index import PrefixIndex, PromptInfo
from pdserve.sim.errors import SimConfigError
from pdserve.sim.worker import SimWorker


@dataclass
class Route:
    """Where one request goes; leases are released as its legs end."""

    decode: SimWorker
    decode_lease: Lease
    prefill: SimWorker | None = None
    prefill_lease: Lease | None = None


class SimRouter:
    def __init__(
        self,
        prefill: Sequence[SimWorker],
        decode: Sequence[SimWorker],
        config: RouterConfig,
    ) -> None:
        # Fed straight from the workers' block managers: their KV events without the wire.
        self.prefix_index = PrefixIndex(config.block_size)
        try:
            pools = [
                WorkerPool(role, make_policy(name, role, config.balance_factor), self.prefix_index)
                for role, name in (
                    (PoolRole.PREFILL, config.prefill_policy),
                    (PoolRole.DECODE, config.decode_policy),
                )
            ]
        except ValueError as exc:
            raise SimConfigError(f"--policy: {exc}") from None
        self.registry = WorkerRegistry(*pools)
        self.local_prefill_threshold = config.local_prefill_threshold
        self.block_size = config.block_size
        self.needs_token_ids = config.needs_token_ids
        self._sim_workers: dict[str, SimWorker] = {}
        for role, workers in ((PoolRole.PREFILL, prefill), (PoolRole.DECODE, decode)):
            for worker in workers:
                self.add_worker(worker, role)

    def add_worker(self, worker: SimWorker, role: PoolRole) -> Worker:
        """Route to `worker` as a member of the `role` pool from now on."""
        entry = self.registry.add(f"sim://{worker.worker_id}", role)
        worker.scheduler.block_manager.cache_observer = self.prefix_index.feed(entry.url)
        entry.state = WorkerState.HEALTHY
        self._sim_workers[entry.worker_id] = worker
        self._scrape(entry)
        return entry

    def move_worker(self, entry: Worker, role: PoolRole) -> Worker:
        """A drained worker joins the other pool (`WorkerRegistry.move`: a new id)."""
        moved = self.registry.move(entry, role)
        self._sim_workers[moved.worker_id] = self._sim_workers.pop(entry.worker_id)
        return moved

    def remove_worker(self, entry: Worker) -> None:
        self.registry.pools[entry.role].remove(entry.worker_id)
        self._sim_workers.pop(entry.worker_id, None)

    def sim_worker(self, worker_id: str) -> SimWorker:
        return self._sim_workers[worker_id]

    def route(self, prompt_token_ids: list[int]) -> Route:
        """Choose the decode worker, and a prefill worker unless the prompt stays local."""
        prompt = (
            PromptInfo.from_token_ids(prompt_token_ids, self.block_size)
            if self.needs_token_ids
            else PromptInfo(len(prompt_token_ids))
        )
        registry = self.registry
        selection = registry.decode.select(prompt)
        route = Route(
            self._sim_workers[selection.worker.worker_id], registry.decode.acquire(selection.worker)
        )
        num_uncached = prompt.num_tokens - selection.num_cached_tokens
        if not registry.prefill.is_staffed or num_uncached < self.local_prefill_threshold:
            return route
        chosen = registry.prefill.select(prompt)
        if chosen is None:  # every prefill worker out of rotation: the router's fallback
            return route
        route.prefill = self._sim_workers[chosen.worker.worker_id]
        route.prefill_lease = registry.prefill.acquire(chosen.worker, prompt.num_tokens)
        return route

    def scrape(self) -> None:
        """Refresh every worker's scraped gauges (what its /metrics would say now)."""
        for entry in self.registry.all_workers():
            self._scrape(entry)

    def _scrape(self, entry: Worker) -> None:
        stats = self._sim_workers[entry.worker_id].scheduler.get_stats()
        entry.scraped = ScrapedLoad(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
