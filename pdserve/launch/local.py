"""One-command serving with a router on one host: `pdserve serve --mode disagg`, or
`--mode colocated|chunked --data-parallel-size N`.

`launch_local(deployment)` starts N prefill and M decode workers (``pdserve serve --role ...``), or
N replicas (``pdserve serve --mode colocated|chunked``: the router's decode pool, each
serving whole requests), as separate processes, each pinned to its own cores with one torch
thread per core, waits until all answer /health, then runs the router in this process until
SIGINT/SIGTERM and stops every child. A worker that dies during startup stops the rest; the
launcher exits 1 with its log tail. Workers get the flags `DeploymentConfig.worker_argv`
gives them, plus their own role, loopback address, thread count and step log (one file per
worker, named after it), and with `--worker-auth` the deployment's fleet secret in their
environment (`pdserve.fleet`; with `--fleet-tls` also a certificate of the deployment's CA).
A replica gets the same, without `--decode-worker-args` (that is the disaggregated decode
pool's); a replica that dies takes only its own requests with it: the router's health checks
take it out of rotation and its other requests go to the rest.

The workers come from a `LocalProvisioner`, the one-host `Provisioner`: the host's cores are
cut into slots (one per worker of the initial layout; with ``--autoscale`` one per worker the
fleet may grow to, at most one per core), and the router's autoscaler starts a worker on a
free slot and stops a drained one, within the cores it has. What every launcher shares (the
Ray one too) is `launch.deployment`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.fleet import FleetCA
from pdserve.launch.config import DeploymentConfig
from pdserve.launch.deployment import (
    WORKER_HOST,
    fleet_membership,
    kv_store_secrets,
    run_deployment,
    worker_command,
    worker_process,
)
from pdserve.launch.worker_group import WorkerGroup, WorkerSpec, WorkerStartupError
from pdserve.ports import free_port
from pdserve.router.provision import WorkerHandle

logger = logging.getLogger("pdserve.launch")


def launch_local(deployment: DeploymentConfig) -> int:
    """Run the deployment until SIGINT/SIGTERM; 0 after a clean stop, 1 if startup failed."""
    specs = plan_workers(deployment)
    slots = core_slots(deployment, len(specs))
    bounds = deployment.autoscale
    autoscale = None if bounds is None else bounds.within(len(slots))
    # Workers listen on loopback, so a secret is opt-in here (--worker-auth, --fleet-tls).
    secret, ca = fleet_membership(deployment)
    config = deployment.router_config(
        tuple(s.url for s in specs if s.role == "prefill"),
        tuple(s.url for s in specs if s.role == "decode"),
        secret,
        ca.issue("router") if ca is not None else None,
    )
    provisioner = LocalProvisioner(deployment, specs, slots, secret, ca)
    _print_plan(deployment, specs)

    def start() -> None:
        provisioner.start_initial()
        provisioner.wait_healthy(deployment.startup_timeout_s)

    return run_deployment(deployment, config, start, provisioner.stop_all, provisioner, autoscale)


def core_slots(deployment: DeploymentConfig, num_initial: int) -> list[tuple[int, ...]]:
    """The cores of each worker the deployment may run at once: one slot per initial worker,
    or with --autoscale one per worker the pools may grow to, at most one per core."""
    cores = sorted(os.sched_getaffinity(0))
    bounds = deployment.autoscale
    if bounds is None:
        return assign_cores(cores, num_initial)
    num_slots = min(bounds.total_limit, len(cores))
    if num_slots < bounds.total_limit:
        logger.warning(
            "--autoscale: %d cores, so at most %d workers (not %d)",
            len(cores),
            num_slots,
            bounds.total_limit,
        )
    if num_initial > num_slots:
        raise ValueError(f"{num_initial} initial workers do not fit on {len(cores)} cores")
    return assign_cores(cores, max(num_slots, 1))


def plan_workers(deployment: DeploymentConfig) -> list[WorkerSpec]:
    """The initial workers, prefill then decode: ports, cores, commands and log files."""
    roles = deployment.initial_roles()
    slots = core_slots(deployment, len(roles))
    log_dir = Path(deployment.worker_log_dir or tempfile.mkdtemp(prefix="pdserve-disagg-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    counts = {"prefill": 0, "decode": 0}
    specs = []
    for slot, role in enumerate(roles):
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        port = _worker_port(deployment.worker_base_port, slot, {s.port for s in specs})
        specs.append(worker_spec(deployment, role, name, port, slots[slot], log_dir))
    return specs


def worker_spec(
    deployment: DeploymentConfig,
    role: str,
    name: str,
    port: int,
    cores: tuple[int, ...],
    log_dir: Path,
) -> WorkerSpec:
    """One worker's command: ``pdserve serve --role ROLE`` (a replica: ``--mode MODE``) on
    loopback, pinned to `cores`."""
    command = worker_command(
        name,
        deployment.role_argv(role),
        deployment.worker_argv(role),
        (WORKER_HOST, port),
        len(cores),
        deployment.step_log,
    )
    log_path = log_dir / f"{name}.log"
    return WorkerSpec(name, role, port, cores, command, log_path, is_tls=deployment.fleet_tls)


@dataclass
class _Child:
    spec: WorkerSpec
    group: WorkerGroup
    slot: int | None  # index into the provisioner's slots (None: cores it does not manage)

    @property
    def handle(self) -> WorkerHandle:
        return WorkerHandle(self.spec.name, self.spec.role, self.spec.url)


class LocalProvisioner:
    """Workers as pinned child processes of this host (the one-host `Provisioner`).

    Each worker holds one slot of cores; a new one takes a free slot (and that slot's port
    with --worker-base-port) and the slot is free again once its worker stopped. Thread-safe:
    the router starts and stops workers from worker threads."""

    def __init__(
        self,
        deployment: DeploymentConfig,
        initial: Sequence[WorkerSpec],
        slots: Sequence[tuple[int, ...]],
        secret: str | None = None,
        ca: FleetCA | None = None,
    ) -> None:
        """`secret` and `ca`: the deployment's fleet secret and --fleet-tls CA, which issues
        each worker its certificate and this launcher its own (for health checks)."""
        self._deployment = deployment
        self._secret = secret
        self._kv_store_secrets = kv_store_secrets(deployment)
        self._ca = ca
        self._tls = ca.issue("launcher").client_context() if ca is not None else None
        self._slots = list(slots)
        self._log_dir = initial[0].log_path.parent if initial else Path(tempfile.mkdtemp())
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}
        self._counts = {"prefill": 0, "decode": 0}
        for spec in initial:
            slot = self._slots.index(spec.cores) if spec.cores in self._slots else None
            if slot is not None and slot in self._used_slots():
                slot = None
            self._children[spec.name] = _Child(spec, self._group(spec), slot)
            self._counts[spec.role] += 1

    # ---- the initial layout, started together (their model loads overlap) ----
    def start_initial(self) -> None:
        for child in list(self._children.values()):
            child.group.start()

    def wait_healthy(self, timeout_s: float) -> None:
        for child in list(self._children.values()):
            child.group.wait_healthy(timeout_s)

    # ---- Provisioner ----
    def start_worker(self, role: str) -> WorkerHandle:
        with self._lock:
            slot = self._free_slot()
            if slot is None:
                raise WorkerStartupError(f"no free cores for another {role} worker")
            name = f"{role}-{self._counts[role]}"
            self._counts[role] += 1
            taken = {c.spec.port for c in self._children.values()}
            port = _worker_port(self._deployment.worker_base_port, slot, taken)
            spec = worker_spec(self._deployment, role, name, port, self._slots[slot], self._log_dir)
            child = self._children[name] = _Child(spec, self._group(spec), slot)
        try:
            child.group.start()
            child.group.wait_healthy(self._deployment.startup_timeout_s)
        except BaseException:
            self.stop_worker(name)
            raise
        logger.info("started %s on cores %s (%s)", name, spec.cores, spec.url)
        return child.handle

    def stop_worker(self, name: str) -> None:
        with self._lock:
            child = self._children.pop(name, None)
        if child is not None:
            child.group.stop()
            logger.info("stopped %s", name)

    def workers(self) -> list[WorkerHandle]:
        with self._lock:
            children = list(self._children.values())
        return [c.handle for c in children if c.group.is_running(c.spec.name)]

    def can_start(self, role: str) -> bool:
        with self._lock:
            return self._free_slot() is not None

    def stop_all(self) -> None:
        with self._lock:
            children, self._children = list(self._children.values()), {}
        for child in children:
            child.group.stop()

    def _group(self, spec: WorkerSpec) -> WorkerGroup:
        tls = self._ca.issue(spec.name) if self._ca is not None else None
        return worker_process(
            spec, self._secret, self._kv_store_secrets, fleet_tls=tls, tls=self._tls
        )

    def _used_slots(self) -> set[int]:
        return {c.slot for c in self._children.values() if c.slot is not None}

    def _free_slot(self) -> int | None:
        used = self._used_slots()
        return next((i for i in range(len(self._slots)) if i not in used), None)


def assign_cores(cores: Sequence[int], num_workers: int) -> list[tuple[int, ...]]:
    """Split `cores` among `num_workers` workers, in order (prefill workers come first).

    With at least one core per worker each gets a contiguous share and the first workers take
    the leftovers (2 cores, 2 workers: core 0 and core 1; 3 cores: (0, 1) and (2,)). With fewer
    cores than workers they share round robin, one core each.
    """
    if num_workers < 1:
        raise ValueError(f"need at least one worker, got {num_workers}")
    if not cores:
        raise ValueError("no CPU cores to pin workers to")
    cores = sorted(cores)
    if len(cores) < num_workers:
        return [(cores[i % len(cores)],) for i in range(num_workers)]
    share, extra = divmod(len(cores), num_workers)
    shares, start = [], 0
    for i in range(num_workers):
        size = share + (1 if i < extra else 0)
        shares.append(tuple(cores[start : start + size]))
        start += size
    return shares


def _worker_port(base_port: int | None, slot: int, taken: set[int]) -> int:
    """base + slot, or a free port outside `taken` (ports given to workers not listening yet:
    a port is free again once its check closes, so two draws can return it twice)."""
    if base_port is not None:
        return base_port + slot
    port = free_port()
    while port in taken:
        port = free_port()
    return port


def _print_plan(deployment: DeploymentConfig, specs: list[WorkerSpec]) -> None:
    mode = deployment.mode.value
    kind = f"{mode} replica " if deployment.is_replicated else ""
    for spec in specs:
        cores = ",".join(map(str, spec.cores))
        print(
            f"pdserve {mode}: {kind}{spec.name} on {spec.url}, cores {cores}, log {spec.log_path}",
            file=sys.stderr,
            flush=True,
        )
