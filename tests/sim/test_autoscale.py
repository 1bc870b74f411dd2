"""`pdserve simulate --autoscale`: the router's planner on simulated pools, and the live
planner deciding exactly as the simulated one on the same metric series."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from dataclasses import replace

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from pdserve.api.metric_names import (
    BUSY_SECONDS,
    ITL_HISTOGRAM,
    KV_USAGE_GAUGE,
    RUNNING_GAUGE,
    TTFT_HISTOGRAM,
    WAITING_GAUGE,
)
from pdserve.core.config import CacheConfig, Mode
from pdserve.router.autoscale.config import SLO, AutoscaleConfig
from pdserve.router.autoscale.loop import Autoscaler
from pdserve.router.autoscale.signals import WorkerSample
from pdserve.router.config import RouterConfig
from pdserve.router.policies import PoolRole
from pdserve.router.provision import WorkerHandle
from pdserve.router.runtime import RouterRuntime
from pdserve.sim.cli import run as run_cli
from pdserve.sim.config import PoolConfig, SimAutoscale, SimConfig, scheduler_config_for
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS
from pdserve.sim.network import get_network
from pdserve.sim.options import load_decisions
from pdserve.sim.simulator import Simulation
from pdserve.sim.workload import SimRequestSpec
from tests.router.harness import AppThread

AUTOSCALE = AutoscaleConfig(
    min_prefill_workers=0,
    max_prefill_workers=2,
    min_decode_workers=1,
    max_decode_workers=2,
    max_workers=3,
    slo=SLO(ttft_s=1.0, itl_s=0.05),
    interval_s=2.0,
    grace_s=4.0,
    scale_down_intervals=3,
)


def shifting_traffic() -> list[SimRequestSpec]:
    """40 s of long prompts (input-heavy), then 60 s of long generations (output-heavy)."""
    rng, specs, t = random.Random(0), [], 0.0
    while t < 40:
        t += rng.expovariate(1.0)
        specs.append(SimRequestSpec(f"in{len(specs)}", t, 2000, 8))
    while t < 100:
        t += rng.expovariate(3.0)
        specs.append(SimRequestSpec(f"out{len(specs)}", t, 64, 256))
    return specs


def sim_config() -> SimConfig:
    sched = scheduler_config_for(Mode.DISAGG, 512, 64, 2048)
    return SimConfig(
        MODELS["SmolLM2-135M"],
        get_hardware("cpu-local"),
        Mode.DISAGG,
        PoolConfig(1, 1, sched),
        PoolConfig(1, 1, sched),
        network=get_network("shm"),
        cache=CacheConfig(kv_cache_memory_gb=1.0),
        is_kv_cache_from_memory=False,
        autoscale=SimAutoscale(AUTOSCALE, startup_s=3.0, switch_s=0.01),
    )


def recorded_run() -> tuple[Simulation, list[tuple[float, list[WorkerSample]]]]:
    """The simulation, with the samples its planner got at each tick."""
    sim = Simulation(sim_config(), shifting_traffic())
    controller = sim.autoscaler.controller
    seen = []
    tick = controller.tick

    def recording(now, samples, can_start):
        seen.append((now, list(samples)))
        return tick(now, samples, can_start)

    controller.tick = recording
    sim.result = sim.run()
    return sim, seen


def test_the_simulated_fleet_grows_switches_and_shrinks_with_the_traffic():
    sim, _ = recorded_run()
    result = sim.result
    decisions = [(d["action"], d["role"], d["reason"]) for d in result.autoscale["decisions"]]
    # Long prompts: another prefill worker. Long generations: an idle prefill worker turns
    # decode worker. Then the prefill pool, idle, shrinks.
    assert decisions[0] == ("add", "prefill", "ttft")
    assert ("switch", "decode", "itl") in decisions
    assert decisions[-1][:2] == ("remove", "prefill")
    assert not [r for r in result.records if r.error]
    outcomes = result.autoscale["outcomes"]
    assert len(outcomes) == len(decisions)
    switch = next(o for o in outcomes if o["decision"]["action"] == "switch")
    assert switch["switch_s"] == 0.01 and switch["previous_id"].startswith("prefill-")
    # The fleet held fewer than 3 workers part of the time.
    assert result.autoscale["worker_seconds"] < 3 * result.duration_s
    spans = result.autoscale["workers"]
    assert len(spans) == 3 and sum(1 for s in spans.values() if s["start_s"] > 0) == 1


def test_simulate_cli_prints_and_saves_the_decisions(tmp_path, capsys):
    from pdserve.cli import build_parser

    args = build_parser().parse_args(
        [
            *("simulate", "--mode", "disagg", "--workload", "mixed", "--num-prompts", "40"),
            *("--request-rate", "4", "--autoscale", "--max-prefill-workers", "2"),
            *("--slo", "ttft:500,itl:50", "--autoscale-interval", "2", "--autoscale-grace", "4"),
            *("--worker-startup", "3", "--save-result", str(tmp_path / "r.json")),
        ]
    )
    assert run_cli(args) == 0
    out = capsys.readouterr().out
    assert "autoscaled" in out and "autoscaler:" in out and "worker-seconds:" in out
    saved = json.loads((tmp_path / "r.json").read_text())["pdserve"]["autoscale"]
    assert saved["config"]["slo"] == {"ttft_ms": 500.0, "itl_ms": 50.0}
    assert saved["decisions"] and saved["startup_s"] == 3.0
    assert all(t["signals"]["decode"]["num_workers"] >= 1 for t in saved["ticks"])


# ---- the live planner on the simulated series -------------------------------------------
def metrics_text(sample: WorkerSample | None) -> str:
    """What a worker's /metrics would say for `sample` (None: an idle worker)."""
    if sample is None:
        sample = WorkerSample("idle", "idle", PoolRole.DECODE)
    lines = [
        f'{RUNNING_GAUGE}{{model_name="m"}} {sample.num_running}',
        f'{WAITING_GAUGE}{{model_name="m"}} {sample.num_waiting}',
        f'{KV_USAGE_GAUGE}{{model_name="m"}} {sample.kv_cache_usage!r}',
        f'{BUSY_SECONDS}{{model_name="m"}} {sample.busy_s!r}',
    ]
    for name, histogram in ((TTFT_HISTOGRAM, sample.ttft), (ITL_HISTOGRAM, sample.itl)):
        for bound, count in zip(histogram.bounds, histogram.counts, strict=True):
            le = "+Inf" if math.isinf(bound) else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}",model_name="m"}} {count!r}')
    return "\n".join(lines) + "\n"


class ReplayWorker(AppThread):
    """A worker whose /metrics the test sets tick by tick; it accepts any role switch."""

    def __init__(self) -> None:
        self.text = metrics_text(None)
        app = FastAPI()
        app.get("/health")(lambda: JSONResponse({"status": "ok"}))
        app.get("/metrics")(lambda: PlainTextResponse(self.text))
        app.post("/role")(lambda: JSONResponse({"drain_s": 0.0, "switch_s": 0.0}))
        super().__init__(app)


class ReplayProvisioner:
    """Starts replay workers at once; `stop_worker` stops them."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[WorkerHandle, ReplayWorker]] = {}
        self._lock = threading.Lock()

    def start_worker(self, role: str) -> WorkerHandle:
        worker = ReplayWorker().__enter__()
        with self._lock:
            handle = WorkerHandle(f"{role}-{len(self.running)}", role, worker.url)
            self.running[handle.name] = (handle, worker)
        return handle

    def stop_worker(self, name: str) -> None:
        with self._lock:
            _, worker = self.running.pop(name)
        worker.__exit__()

    def workers(self) -> list[WorkerHandle]:
        with self._lock:
            return [handle for handle, _ in self.running.values()]

    def can_start(self, role: str) -> bool:
        return True

    def by_url(self) -> dict[str, ReplayWorker]:
        with self._lock:
            return {handle.url: worker for handle, worker in self.running.values()}


async def replay(series: list[tuple[float, list[WorkerSample]]]) -> list[dict]:
    """The live router's planner over `series`: at each tick every routable worker's /metrics
    says what the simulated worker of the same id said; changes run to completion."""
    provisioner = ReplayProvisioner()
    initial = [provisioner.start_worker(role) for role in ("prefill", "decode")]
    config = RouterConfig(
        prefill_urls=(initial[0].url,), decode_urls=(initial[1].url,), health_interval_s=60.0
    )
    runtime = RouterRuntime(config, provisioner=provisioner)
    await runtime.start()
    autoscaler = Autoscaler(
        AUTOSCALE, runtime.registry, runtime.client, runtime.actions, runtime.metrics
    )
    try:
        for now, samples in series:
            by_id = {s.worker_id: s for s in samples}
            workers = provisioner.by_url()
            for entry in runtime.registry.all_workers():
                workers[entry.url].text = metrics_text(by_id.get(entry.worker_id))
            assert {w.worker_id for w in runtime.registry.all_workers() if w.is_routable} == set(
                by_id
            ), f"the live fleet differs from the simulated one at {now} s"
            decision = await autoscaler.tick(now)
            if decision is not None and decision.worker_id is not None:
                # Drained, its engine empties (as in the simulation, where it left idle).
                workers[runtime.registry.get(decision.worker_id).url].text = metrics_text(None)
            await autoscaler.wait_idle()
        return [d.to_dict() for d in autoscaler.controller.decisions]
    finally:
        await runtime.stop()
        for name in list(provisioner.running):
            provisioner.stop_worker(name)


def test_the_live_planner_decides_as_the_simulated_one_on_the_same_series():
    sim, series = recorded_run()
    simulated = sim.result.autoscale["decisions"]
    assert {d["action"] for d in simulated} == {"add", "switch", "remove"}
    assert asyncio.run(replay(series)) == simulated


def test_a_simulated_addition_starts_all_the_workers_it_was_sized_for():
    """With --autoscale-max-step the long prompts' TTFT, far past its SLO, gets several
    prefill workers in one addition; each counts from its start and serves once started."""
    config = sim_config()
    autoscale = replace(
        AUTOSCALE, max_prefill_workers=4, max_workers=5, max_step_workers=4, interval_s=1.0
    )
    config = replace(config, autoscale=replace(config.autoscale, config=autoscale))
    result = Simulation(config, shifting_traffic()).run()
    first = next(d for d in result.autoscale["decisions"] if d["num_workers"] > 1)
    assert (first["action"], first["role"], first["reason"]) == ("add", "prefill", "ttft")
    (outcome,) = [o for o in result.autoscale["outcomes"] if o["decision"] == first]
    assert len(outcome["worker_ids"]) == first["num_workers"]
    started = [s for s in result.autoscale["workers"].values() if s["start_s"] > 0]
    assert len(started) >= first["num_workers"]
    assert not [r for r in result.records if r.error]


def test_replaying_a_runs_decisions_retraces_its_path(tmp_path):
    """--autoscale-decisions: the planner's own decisions, replayed from a file, give the
    same fleet changes at the same ticks and the same requests' latencies."""
    own = Simulation(sim_config(), shifting_traffic()).run()
    path = tmp_path / "decisions.json"
    path.write_text(json.dumps({"decisions": own.autoscale["decisions"]}))
    config = sim_config()
    replay = load_decisions(path)
    config = replace(config, autoscale=replace(config.autoscale, replay=replay))
    replayed = Simulation(config, shifting_traffic()).run()
    assert replayed.autoscale["decisions"] == own.autoscale["decisions"]
    assert [r.ttft for r in replayed.records] == [r.ttft for r in own.records]
    (tmp_path / "bad.json").write_text('[{"time_s": 1}]')
    with pytest.raises(SimConfigError, match=r"--autoscale-decisions: .*bad\.json"):
        load_decisions(tmp_path / "bad.json")
