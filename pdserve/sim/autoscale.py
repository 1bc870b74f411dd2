"""`pdserve simulate --autoscale`: the router's autoscaler on simulated pools.

Every `interval_s` of simulated time, unless a change is under way, each routable worker's
`WorkerSample` (what its /metrics would say: the scheduler's gauges, its busy seconds, TTFT
and ITL histograms in the server's own buckets, plus the router's pending prompt tokens) goes
to the same `router.autoscale.planner.AutoscaleController` the live router runs, and its decision is
carried out on the simulated fleet as the router's `FleetActions` would:

- add: a new worker joins its pool `startup_s` later (its model loads meanwhile);
- remove: the router stops routing to the worker; it leaves once nothing of it is in flight
  and its engine is empty (KV it leased fetched);
- switch: the same drain, then `switch_s`, then it serves the other pool under a new id.

Worker-seconds count each worker from its start (startup included) to its removal or the end
of the run: what a fleet of that shape would have held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.router.autoscale.histogram import HistogramRecorder
from pdserve.router.autoscale.planner import Action, AutoscaleController, Decision
from pdserve.router.autoscale.signals import WorkerSample
from pdserve.router.policies import PoolRole
from pdserve.router.pool import Worker
from pdserve.server.metrics import LATENCY_BUCKETS
from pdserve.sim.config import SimAutoscale
from pdserve.sim.router import SimRouter
from pdserve.sim.worker import SimWorker


class _Pool(Protocol):
    workers: list[SimWorker]


class SimFleet(Protocol):
    """What a `SimAutoscaler` drives: the `Simulation` that makes it (`sim.simulator`), its
    clock, events, router and pools; a protocol, so that this module needs none of it."""

    now: float
    router: SimRouter
    prefill: _Pool | None
    main: _Pool

    @property
    def has_open_requests(self) -> bool: ...

    def schedule(self, when: float, handler: Callable[[object], None]) -> None: ...

    def add_worker(self, role: PoolRole) -> SimWorker: ...

    def remove_worker(self, entry: Worker) -> None: ...

    def move_worker(self, entry: Worker, role: PoolRole) -> Worker: ...


@dataclass
class _Drain:
    decision: Decision
    entry: Worker
    started: float


class SimAutoscaler:
    """Drives one `Simulation`'s pools (see the module docstring)."""

    def __init__(self, sim: SimFleet, spec: SimAutoscale) -> None:
        self.sim = sim
        self.spec = spec
        self.controller = AutoscaleController(spec.config, spec.replay)
        self._ttft: dict[str, HistogramRecorder] = {}
        self._itl: dict[str, HistogramRecorder] = {}
        self._is_changing = False
        self._drain: _Drain | None = None
        # Each worker's [start, end) in simulated seconds (end None: still running).
        self.lifetimes: dict[str, list[float | None]] = {}
        self.outcomes: list[dict[str, Any]] = []

    # ---- hooks the simulation calls ----------------------------------------------------
    def start(self) -> None:
        for worker in self._pool_workers():
            self.lifetimes[worker.worker_id] = [0.0, None]
        self.sim.schedule(self.spec.config.interval_s, self._on_tick)

    def on_ttft(self, worker: SimWorker, seconds: float) -> None:
        self._recorder(self._ttft, worker).observe(seconds)

    def on_itl(self, worker: SimWorker, seconds: float) -> None:
        self._recorder(self._itl, worker).observe(seconds)

    def on_idle(self, worker: SimWorker) -> None:
        """`worker` has nothing to step: a drain waiting on it may be complete."""
        drain = self._drain
        if drain is not None and self.sim.router.sim_worker(drain.entry.worker_id) is worker:
            self._finish_drain_if_done()

    def summary(self) -> dict[str, Any]:
        end = self.sim.now
        spans = {w: (s, end if e is None else e) for w, (s, e) in self.lifetimes.items()}
        return {
            "config": self.spec.config.to_dict(),
            "startup_s": self.spec.startup_s,
            "switch_s": self.spec.switch_s,
            "decisions": [d.to_dict() for d in self.controller.decisions],
            "outcomes": self.outcomes,
            "ticks": [t.to_dict() for t in self.controller.ticks],
            "worker_seconds": sum(e - s for s, e in spans.values()),
            "workers": {w: {"start_s": s, "end_s": e} for w, (s, e) in spans.items()},
        }

    # ---- the planner loop --------------------------------------------------------------
    def _on_tick(self, _: object) -> None:
        if not self.sim.has_open_requests:
            return  # the run is over: nothing more to scale for
        if not self._is_changing:
            room = {role: True for role in PoolRole}  # the planner's max_workers bounds it
            decision = self.controller.tick(self.sim.now, self._samples(), room)
            if decision is not None:
                self._begin(decision)
        self.sim.schedule(self.sim.now + self.spec.config.interval_s, self._on_tick)

    def _samples(self) -> list[WorkerSample]:
        router = self.sim.router
        samples = []
        for entry in router.registry.all_workers():
            if not entry.is_routable:
                continue
            worker = router.sim_worker(entry.worker_id)
            stats = worker.scheduler.get_stats()
            samples.append(
                WorkerSample(
                    worker_id=entry.worker_id,
                    key=entry.url,
                    role=entry.role,
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    kv_cache_usage=stats.kv_cache_usage,
                    num_pending_prompt_tokens=entry.num_inflight_prefill_tokens,
                    busy_s=worker.stats.busy_s,
                    ttft=self._recorder(self._ttft, worker).snapshot(),
                    itl=self._recorder(self._itl, worker).snapshot(),
                )
            )
        return samples

    def _begin(self, decision: Decision) -> None:
        self._is_changing = True
        if decision.action is Action.ADD:
            workers = [self.sim.add_worker(decision.role) for _ in range(decision.num_workers)]
            for worker in workers:
                self.lifetimes[worker.worker_id] = [self.sim.now, None]
            self.sim.schedule(
                self.sim.now + self.spec.startup_s, lambda _: self._finish_add(decision, workers)
            )
            return
        entry = self.sim.router.registry.drain(
            decision.worker_id, is_switching=decision.action is Action.SWITCH
        )
        self._drain = _Drain(decision, entry, self.sim.now)
        self._finish_drain_if_done()

    def _finish_add(self, decision: Decision, workers: list[SimWorker]) -> None:
        entries = [self.sim.router.add_worker(worker, decision.role) for worker in workers]
        self._done(decision, worker_ids=[entry.worker_id for entry in entries])

    def _finish_drain_if_done(self) -> None:
        drain = self._drain
        worker = self.sim.router.sim_worker(drain.entry.worker_id)
        scheduler = worker.scheduler
        if (
            drain.entry.num_inflight
            or worker.is_busy
            or scheduler.has_unfinished_requests()
            or scheduler.has_pending_transfers()
        ):
            return
        self._drain = None
        drain_s = self.sim.now - drain.started
        if drain.decision.action is Action.REMOVE:
            self.sim.remove_worker(drain.entry)
            self.lifetimes[worker.worker_id][1] = self.sim.now
            self._done(drain.decision, drain_s=drain_s)
            return

        def switched(_: object) -> None:
            moved = self.sim.move_worker(drain.entry, drain.decision.role)
            self._done(
                drain.decision,
                worker_id=moved.worker_id,
                previous_id=drain.entry.worker_id,
                drain_s=drain_s,
                switch_s=self.spec.switch_s,
            )

        self.sim.schedule(self.sim.now + self.spec.switch_s, switched)

    def _done(self, decision: Decision, **outcome: Any) -> None:
        self.outcomes.append({"decision": decision.to_dict(), "done_s": self.sim.now, **outcome})
        self._is_changing = False

    # ---- helpers -----------------------------------------------------------------------
    def _pool_workers(self) -> list[SimWorker]:
        return [w for pool in (self.sim.prefill, self.sim.main) if pool for w in pool.workers]

    @staticmethod
    def _recorder(recorders: dict[str, HistogramRecorder], worker: SimWorker) -> HistogramRecorder:
        if worker.worker_id not in recorders:
            recorders[worker.worker_id] = HistogramRecorder(LATENCY_BUCKETS)
        return recorders[worker.worker_id]
