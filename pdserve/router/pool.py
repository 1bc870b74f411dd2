"""Workers as the router sees them (address, health, drain flag, in-flight and scraped load)
and their pools (prefill, decode): membership, selection through a policy, in-flight leases.

Draining: a worker marked draining takes no new request; when its in-flight count reaches 0
the pool's drain listeners hear of it, and it leaves its pool, unless it is switching pools
(`WorkerRegistry.move` then puts it in the other one)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.policies import PoolRole, RoutingPolicy, WorkerLoad
from pdserve.router.prefix_index import PrefixIndex, PromptInfo


class WorkerState(enum.Enum):
    # Not checked yet: out of rotation until its first health check passes.
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    # Circuit open: failed health checks or a broken connection; back on a passing check.
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True)
class ScrapedLoad:
    """Gauges read from the worker's /metrics (`pdserve:*`); None where it does not export one."""

    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None


@dataclass
class Worker:
    worker_id: str
    url: str
    role: PoolRole
    state: WorkerState = WorkerState.UNKNOWN
    # Draining: takes no new requests; removed once `num_inflight` reaches 0.
    is_draining: bool = False
    # Draining to change pools: stays registered once drained, until it moves.
    is_switching: bool = False
    num_consecutive_failures: int = 0
    last_error: str | None = None
    num_inflight: int = 0
    num_inflight_prefill_tokens: int = 0
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    # Where it runs (a Ray node id), when its provisioner knows; None on one host.
    node_id: str | None = None
    # What its KV events say it caches (its pool's index; None outside a pool).
    prefix_index: PrefixIndex | None = field(default=None, repr=False, compare=False)

    @property
    def num_indexed_blocks(self) -> int:
        return 0 if self.prefix_index is None else self.prefix_index.num_blocks(self.url)

    @property
    def is_routable(self) -> bool:
        return self.state is WorkerState.HEALTHY and not self.is_draining

    def load(self, num_cached_tokens: int = 0) -> WorkerLoad:
        """The policy's view. Sequences are the larger of the scraped count and the router's
        own in-flight count: the scrape is seconds old, the in-flight count is exact but
        misses requests that reached the worker some other way."""
        scraped = self.scraped
        return WorkerLoad(
            num_running=max(scraped.num_running or 0, self.num_inflight),
            num_waiting=scraped.num_waiting or 0,
            num_pending_prefill_tokens=self.num_inflight_prefill_tokens,
            kv_cache_usage=scraped.kv_cache_usage or 0.0,
            num_cached_tokens=num_cached_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        """The record `GET /workers` returns."""
        return {
            "id": self.worker_id,
            "url": self.url,
            "role": self.role.value,
            "node_id": self.node_id,
            "state": self.state.value,
            "draining": self.is_draining,
            "switching": self.is_switching,
            "num_inflight": self.num_inflight,
            "num_inflight_prefill_tokens": self.num_inflight_prefill_tokens,
            "num_running": self.scraped.num_running,
            "num_waiting": self.scraped.num_waiting,
            "kv_cache_usage": self.scraped.kv_cache_usage,
            "num_indexed_blocks": self.num_indexed_blocks,
            "last_error": self.last_error,
        }


@dataclass(frozen=True)
class Selection:
    worker: Worker
    # Tokens of the prompt the worker's KV events say it has cached (its predicted hit).
    num_cached_tokens: int


class DuplicateWorkerError(ValueError):
    """A worker with that role and URL is already registered."""


class Lease:
    """One request's share of a worker's in-flight counts; `release` is idempotent."""

    def __init__(self, pool: WorkerPool, worker: Worker, num_prefill_tokens: int) -> None:
        self._pool = pool
        self.worker = worker
        self._num_prefill_tokens = num_prefill_tokens
        self._is_released = False
        worker.num_inflight += 1
        worker.num_inflight_prefill_tokens += num_prefill_tokens

    def release(self) -> None:
        if self._is_released:
            return
        self._is_released = True
        self.worker.num_inflight -= 1
        self.worker.num_inflight_prefill_tokens -= self._num_prefill_tokens
        self._pool.on_released(self.worker)


class WorkerPool:
    """The workers of one role. Selection only considers routable (healthy, not draining)
    workers, each with the prompt's prefix the index says it caches."""

    def __init__(self, role: PoolRole, policy: RoutingPolicy, prefix_index: PrefixIndex) -> None:
        self.role = role
        self.policy = policy
        self.prefix_index = prefix_index
        self.workers: dict[str, Worker] = {}
        # Called with each draining worker once nothing of it is in flight any more.
        self.drain_listeners: list[Callable[[Worker], None]] = []

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    @property
    def is_staffed(self) -> bool:
        """Some worker belongs to the pool and is not draining (in rotation, or out of it
        until its health returns). A pool whose every worker drains is being emptied on
        purpose: its requests go elsewhere without counting as failures."""
        return any(not w.is_draining for w in self.workers.values())

    def routable(self, exclude: Collection[str] = ()) -> list[Worker]:
        return [w for w in self.workers.values() if w.is_routable and w.worker_id not in exclude]

    def select(self, prompt: PromptInfo, exclude: Collection[str] = ()) -> Selection | None:
        """Pick a worker for `prompt` (None when no routable worker is left)."""
        candidates = self.routable(exclude)
        if not candidates:
            return None
        cached = [
            self.prefix_index.num_cached_tokens(w.url, prompt.block_hashes, prompt.num_tokens)
            if prompt.block_hashes
            else 0
            for w in candidates
        ]
        loads = [w.load(n) for w, n in zip(candidates, cached, strict=True)]
        index = self.policy.select(loads, prompt.num_tokens)
        return Selection(candidates[index], cached[index])

    def acquire(self, worker: Worker, num_prefill_tokens: int = 0) -> Lease:
        return Lease(self, worker, num_prefill_tokens)

    def add(self, worker: Worker) -> None:
        self.workers[worker.worker_id] = worker

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def on_released(self, worker: Worker) -> None:
        if not (worker.is_draining and worker.num_inflight == 0):
            return
        if not worker.is_switching:
            self.remove(worker.worker_id)
        for listener in self.drain_listeners:
            listener(worker)


class WorkerRegistry:
    """Both pools, and the runtime add / drain / lookup behind ``/workers``."""

    def __init__(self, prefill: WorkerPool, decode: WorkerPool) -> None:
        self.pools = {PoolRole.PREFILL: prefill, PoolRole.DECODE: decode}
        self._next_index = {role: itertools.count() for role in PoolRole}

    @property
    def prefill(self) -> WorkerPool:
        return self.pools[PoolRole.PREFILL]

    @property
    def decode(self) -> WorkerPool:
        return self.pools[PoolRole.DECODE]

    def all_workers(self) -> list[Worker]:
        return [w for pool in self.pools.values() for w in pool]

    def get(self, worker_id: str) -> Worker | None:
        for pool in self.pools.values():
            if worker_id in pool.workers:
                return pool.workers[worker_id]
        return None

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self.all_workers() if w.url == url), None)

    def add(
        self, url: str, role: PoolRole, *, worker_id: str | None = None, node_id: str | None = None
    ) -> Worker:
        """Register a worker (out of rotation until its first health check passes), under its
        provisioner's name `worker_id` if it has one."""
        pool = self.pools[role]
        if any(w.url == url for w in pool):
            raise DuplicateWorkerError(f"url: a {role.value} worker at {url} is already registered")
        if worker_id is None:
            # Skip names a provisioner gave (discovered workers keep theirs).
            worker_id = next(
                name
                for name in (f"{role.value}-{i}" for i in self._next_index[role])
                if self.get(name) is None
            )
        elif self.get(worker_id) is not None:
            raise DuplicateWorkerError(f"a worker named {worker_id} is already registered")
        worker = Worker(worker_id, url, role, node_id=node_id, prefix_index=pool.prefix_index)
        pool.add(worker)
        return worker

    def drain(self, worker_id: str, is_switching: bool = False) -> Worker | None:
        """Stop routing to the worker; once its in-flight count is 0 it leaves its pool, or
        with `is_switching` waits there for `move`."""
        worker = self.get(worker_id)
        if worker is None:
            return None
        worker.is_draining = True
        worker.is_switching = is_switching
        self.pools[worker.role].on_released(worker)
        return worker

    def undrain(self, worker: Worker) -> None:
        """Back in rotation (a switch that failed)."""
        worker.is_draining = worker.is_switching = False

    def move(self, worker: Worker, role: PoolRole) -> Worker:
        """A drained worker that now serves as `role` leaves its pool and joins the other
        under a new id, in the health state it had."""
        self.pools[worker.role].remove(worker.worker_id)
        moved = self.add(worker.url, role, node_id=worker.node_id)
        moved.state = worker.state
        return moved

    def add_drain_listener(self, listener: Callable[[Worker], None]) -> None:
        for pool in self.pools.values():
            pool.drain_listeners.append(listener)

    def is_registered(self, worker: Worker) -> bool:
        return self.pools[worker.role].workers.get(worker.worker_id) is worker
