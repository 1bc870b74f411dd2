"""The router's side of autoscaling: the fleet changes (`FleetActions`: add a worker, drain and
stop one, switch one between the pools) and the planner loop (`Autoscaler`) that reads each
worker's /metrics every interval, asks `planner.AutoscaleController` and makes its change.

A change runs in the background; the loop takes no decision while one is under way, so a
slow worker start or a long drain never overlaps another change. Removal and switching
always drain first: the router stops routing to the worker, waits for its in-flight
requests, and (removal) for the KV a prefill worker still leases to be fetched, so no
request is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from pdserve.api.errors import APIError, ErrorType
from pdserve.api.metric_names import BUSY_SECONDS, ITL_HISTOGRAM, TTFT_HISTOGRAM
from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.autoscale.planner import MAX_DECISIONS, Action, AutoscaleController, Decision
from pdserve.router.autoscale.signals import WorkerSample
from pdserve.router.health import HealthMonitor, parse_histogram, parse_total, parse_worker_load
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import PoolRole
from pdserve.router.pool import Worker, WorkerRegistry, WorkerState

if TYPE_CHECKING:
    from pdserve.router.provision import Provisioner

logger = logging.getLogger("pdserve.router.autoscale")

# How often a drained worker's /metrics is polled until its engine is empty.
_IDLE_POLL_S = 0.2


class FleetActions:
    """Changes to the fleet, for the autoscaler and the ``/workers`` API. Adding and stopping
    workers needs a `Provisioner`; switching needs only the workers' ``POST /role``."""

    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        health: HealthMonitor,
        provisioner: Provisioner | None = None,
        *,
        idle_timeout_s: float = 60.0,
    ) -> None:
        self.registry = registry
        self.client = client
        self.health = health
        self.provisioner = provisioner
        self.idle_timeout_s = idle_timeout_s
        self._drained: dict[str, asyncio.Event] = {}
        registry.add_drain_listener(self._on_drained)

    def can_start(self, role: PoolRole) -> bool:
        return self.provisioner is not None and self.provisioner.can_start(role.value)

    def owns(self, worker: Worker) -> bool:
        """Whether the provisioner started `worker` (and so can stop it)."""
        return self._handle_name(worker) is not None

    async def add(self, role: PoolRole) -> Worker:
        """Start a worker of `role` and put it in rotation once healthy."""
        if self.provisioner is None:
            raise RuntimeError("no provisioner: workers are started elsewhere")
        handle = await asyncio.to_thread(self.provisioner.start_worker, role.value)
        # Where the router discovers the provisioner's workers, it may have registered this
        # one already, under its provisioner's name.
        worker = self.registry.by_url(handle.url) or self.registry.add(
            handle.url, role, node_id=handle.node_id
        )
        await self.health.check(worker)
        logger.info("added %s (%s, %s)", worker.worker_id, handle.name, handle.url)
        return worker

    async def remove(self, worker: Worker) -> dict[str, Any]:
        """Drain `worker`, wait until its engine is empty, then stop it (when the provisioner
        started it; otherwise it only leaves the router)."""
        started = time.monotonic()
        self.registry.drain(worker.worker_id)
        await self.wait_drained(worker)
        drained = time.monotonic()
        name = self._handle_name(worker)
        if name is not None:
            await self._wait_engine_empty(worker)
            await asyncio.to_thread(self.provisioner.stop_worker, name)
        logger.info("removed %s after draining %.2f s", worker.worker_id, drained - started)
        return {"drain_s": drained - started, "total_s": time.monotonic() - started}

    async def switch(self, worker: Worker, role: PoolRole, timeout_s: float) -> dict[str, Any]:
        """Drain `worker`, have it switch to `role` in place, move it to that pool. Raises
        `APIError` (409 when the switch is not possible now, 502 when the worker failed)."""
        self._check_switch(worker, role)
        started = time.monotonic()
        self.registry.drain(worker.worker_id, is_switching=True)
        try:
            await asyncio.wait_for(self.wait_drained(worker), timeout_s)
            drained = time.monotonic()
            answer = await self._post_role(worker, role, max(timeout_s - (drained - started), 1))
        except BaseException as exc:
            self.registry.undrain(worker)
            if isinstance(exc, TimeoutError):
                raise APIError(
                    ErrorType.CONFLICT,
                    f"worker {worker.worker_id} still had requests in flight after "
                    f"{timeout_s:g} s; it stays a {worker.role.value} worker",
                    param="timeout_s",
                    code="busy",
                ) from None
            raise
        moved = self.registry.move(worker, role)
        result = {
            "worker": moved.to_dict(),
            "previous_id": worker.worker_id,
            # The router's drain (its in-flight requests), then the worker's own wait for its
            # engine to empty (KV still leased or arriving), then the switch itself.
            "router_drain_s": drained - started,
            "worker_drain_s": answer.get("drain_s"),
            "switch_s": answer.get("switch_s"),
            "total_s": time.monotonic() - started,
        }
        logger.info(
            "switched %s -> %s in %.2f s (router drain %.2f s, worker drain %.3f s, switch %.4f s)",
            worker.worker_id,
            moved.worker_id,
            result["total_s"],
            result["router_drain_s"],
            result["worker_drain_s"] or 0.0,
            result["switch_s"] or 0.0,
        )
        return result

    async def wait_drained(self, worker: Worker) -> None:
        """Until the router has nothing in flight on a draining `worker`."""
        if worker.num_inflight == 0:
            return
        event = self._drained.setdefault(worker.worker_id, asyncio.Event())
        try:
            await event.wait()
        finally:
            self._drained.pop(worker.worker_id, None)

    def _on_drained(self, worker: Worker) -> None:
        event = self._drained.get(worker.worker_id)
        if event is not None:
            event.set()

    def _check_switch(self, worker: Worker, role: PoolRole) -> None:
        problem = None
        if worker.role is role:
            problem = f"worker {worker.worker_id} is a {role.value} worker already"
        elif worker.is_draining:
            problem = f"worker {worker.worker_id} is draining"
        elif any(w.url == worker.url for w in self.registry.pools[role]):
            problem = f"{worker.url} is in the {role.value} pool already"
        elif worker.state is not WorkerState.HEALTHY:
            problem = f"worker {worker.worker_id} is {worker.state.value}: no switch until healthy"
        elif worker.role is PoolRole.DECODE and not [
            w for w in self.registry.decode.routable() if w is not worker
        ]:
            problem = "the last decode worker in rotation cannot leave its pool"
        if problem is not None:
            raise APIError(ErrorType.CONFLICT, problem, param="role", code="cannot_switch")

    async def _post_role(self, worker: Worker, role: PoolRole, timeout_s: float) -> dict:
        try:
            response = await self.client.post(
                f"{worker.url}/role",
                json={"role": role.value, "timeout_s": timeout_s},
                timeout=timeout_s + 10,
            )
        except httpx.HTTPError as exc:
            raise APIError(
                ErrorType.BAD_GATEWAY,
                f"worker {worker.worker_id}: POST /role failed: {type(exc).__name__}",
                code="switch_failed",
            ) from exc
        if response.status_code != 200:
            raise APIError(
                ErrorType.BAD_GATEWAY if response.status_code >= 500 else ErrorType.CONFLICT,
                f"worker {worker.worker_id} refused the switch ({response.status_code}): "
                f"{_error_message(response)}",
                code="switch_failed",
            )
        return response.json()

    async def _wait_engine_empty(self, worker: Worker) -> None:
        """Until the worker's /metrics shows nothing running, waiting or held (a prefill
        worker's leased KV is fetched by decode workers after the router's leg ended)."""
        deadline = time.monotonic() + self.idle_timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                response = await self.client.get(f"{worker.url}/metrics", timeout=5.0)
                load = parse_worker_load(response.text)
                if not (load.num_running or load.num_waiting or load.kv_cache_usage):
                    return
            await asyncio.sleep(_IDLE_POLL_S)
        logger.warning(
            "%s still busy %.0f s after draining; stopping it anyway",
            worker.worker_id,
            self.idle_timeout_s,
        )

    def _handle_name(self, worker: Worker) -> str | None:
        if self.provisioner is None:
            return None
        for handle in self.provisioner.workers():
            if handle.url == worker.url:
                return handle.name
        return None


class Autoscaler:
    """The planner loop: every `interval_s`, unless a change is under way, sample the
    routable workers, decide, and start the change."""

    def __init__(
        self,
        config: AutoscaleConfig,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        actions: FleetActions,
        metrics: RouterMetrics,
        *,
        scrape_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.controller = AutoscaleController(config)
        self.registry = registry
        self.client = client
        self.actions = actions
        self.metrics = metrics
        self.scrape_timeout_s = scrape_timeout_s
        self._clock = clock
        self._started_at = clock()
        self._change: asyncio.Task | None = None
        # What each change did (drain and switch seconds), in order, for GET /autoscale: the
        # latest, as many as the controller keeps decisions.
        self.outcomes: deque[dict[str, Any]] = deque(maxlen=MAX_DECISIONS)

    @property
    def uptime_s(self) -> float:
        """The planner's clock: seconds since it started (decisions' `time_s`)."""
        return self._clock() - self._started_at

    @property
    def is_busy(self) -> bool:
        return self._change is not None and not self._change.done()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except Exception:  # the loop must outlive a bad tick
                logger.exception("autoscaler tick failed")

    async def tick(self, now: float | None = None) -> Decision | None:
        """One planner round (`now`: seconds since the autoscaler started)."""
        if self.is_busy:
            return None
        now = self.uptime_s if now is None else now
        samples = await self.samples()
        can_start = {role: self.actions.can_start(role) for role in PoolRole}
        decision = self.controller.tick(now, samples, can_start)
        if decision is not None:
            logger.info("autoscale at %.1f s: %s", now, decision.describe())
            self.metrics.count_decision(decision)
            self._change = asyncio.create_task(self._make(decision))
        return decision

    async def wait_idle(self) -> None:
        """Until the change under way (if any) is done."""
        if self._change is not None:
            await asyncio.wait([self._change])

    async def stop(self) -> None:
        if self._change is not None:
            self._change.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._change

    async def samples(self) -> list[WorkerSample]:
        """Each routable worker's /metrics now, in the order the workers joined their pools
        (a worker that does not answer is left out this tick)."""
        workers = [w for w in self.registry.all_workers() if w.is_routable]
        texts = await asyncio.gather(*(self._scrape(w) for w in workers))
        return [
            _sample(worker, text)
            for worker, text in zip(workers, texts, strict=True)
            if text is not None
        ]

    async def _scrape(self, worker: Worker) -> str | None:
        try:
            response = await self.client.get(f"{worker.url}/metrics", timeout=self.scrape_timeout_s)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def _make(self, decision: Decision) -> None:
        outcome: dict[str, Any] = {"decision": decision.to_dict()}
        try:
            if decision.action is Action.ADD:
                # Together; a worker that failed to start leaves the others in the pool.
                added = await asyncio.gather(
                    *(self.actions.add(decision.role) for _ in range(decision.num_workers)),
                    return_exceptions=True,
                )
                outcome["worker_ids"] = [w.worker_id for w in added if isinstance(w, Worker)]
                failed = [e for e in added if isinstance(e, Exception)]
                if failed:
                    raise failed[0]
            else:
                worker = self.registry.get(decision.worker_id)
                if worker is None:
                    raise RuntimeError(f"worker {decision.worker_id} is gone")
                if decision.action is Action.REMOVE:
                    outcome.update(await self.actions.remove(worker))
                else:
                    outcome.update(
                        await self.actions.switch(
                            worker, decision.role, self.actions.idle_timeout_s
                        )
                    )
        except Exception as exc:
            outcome["error"] = str(exc)
            logger.warning("autoscale: %s failed: %s", decision.describe(), exc)
        outcome["done_s"] = self.uptime_s
        self.outcomes.append(outcome)

    def to_dict(self) -> dict[str, Any]:
        """``GET /autoscale``: the config, the decisions and what they did, the last tick."""
        ticks = self.controller.ticks
        return {
            "config": self.config.to_dict(),
            "decisions": [d.to_dict() for d in self.controller.decisions],
            "outcomes": list(self.outcomes),
            "last_tick": ticks[-1].to_dict() if ticks else None,
            "busy": self.is_busy,
            "uptime_s": self.uptime_s,
        }


def _sample(worker: Worker, text: str) -> WorkerSample:
    load = parse_worker_load(text)
    return WorkerSample(
        worker_id=worker.worker_id,
        key=worker.url,
        role=worker.role,
        num_running=load.num_running or 0,
        num_waiting=load.num_waiting or 0,
        kv_cache_usage=load.kv_cache_usage or 0.0,
        num_pending_prompt_tokens=worker.num_inflight_prefill_tokens,
        busy_s=parse_total(text, BUSY_SECONDS),
        ttft=parse_histogram(text, TTFT_HISTOGRAM),
        itl=parse_histogram(text, ITL_HISTOGRAM),
    )


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
