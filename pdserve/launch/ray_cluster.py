"""`pdserve serve --mode disagg --cluster ray` (or `--mode colocated|chunked
--data-parallel-size N --cluster ray`): the workers as Ray actors across a cluster.

Each worker is one `pdserve serve --role prefill|decode` process (a replica: `pdserve serve
--mode colocated|chunked`, in the decode pool, with its resources), started by a small Ray
actor (`WorkerHost`) on the node Ray places it on with the resources its pool asks for
(`--prefill-worker-resources`, `--decode-worker-resources`, Ray's JSON spelling; with
`--placement-strategy`, the first workers in one placement group). The process listens on its
node's address, and its KV moves with `--kv-transport auto`: shared memory with a peer on its
own Ray node, tcp with the others. Actor and process live and die together: the process gets
SIGKILL the moment the actor's process is gone (its node died, or `ray.kill`), as it would
with its node.

`RayProvisioner` implements `router.provision.Provisioner`: it starts and stops workers, keeps
the list of those running (read by the router before every health round: its discovery, so
there is no static URL list), and watches every actor. A worker that dies without being
stopped leaves that list at once and is replaced on a node that has the resources (its
placement-group bundle, where it had one), so each pool returns to its size. The router runs
in this process, as on one host (`launch.deployment.run_deployment`).

Every worker is handed the deployment's fleet secret (`pdserve.fleet`) and the store's secrets
(`launch.deployment.worker_secrets`) through Ray (its actor's arguments) and on to its process
in the environment; with `--fleet-tls` also its own certificate, issued here by the
deployment's CA (whose key never leaves this process). The Ray cluster itself is the trust
boundary above that: whoever may submit Ray jobs to it runs code on its nodes.

Ray is imported only here, and only when a cluster is asked for.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import math
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.flags import MissingExtraError
from pdserve.fleet import FleetCA, FleetTLS
from pdserve.launch.config import DeploymentConfig
from pdserve.launch.deployment import (
    fleet_membership,
    kv_store_secrets,
    run_deployment,
    worker_command,
    worker_process,
)
from pdserve.launch.worker_group import PortTakenError, WorkerSpec, WorkerStartupError
from pdserve.ports import free_port
from pdserve.router.provision import WorkerHandle

logger = logging.getLogger("pdserve.launch")

ROLES = ("prefill", "decode")
DEFAULT_RESOURCES = {"CPU": 1.0}
PORT_ATTEMPTS = 5  # free ports a worker's host tries, each taken first by another process
PLACEMENT_STRATEGIES = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}
# Concurrent calls one worker's actor serves: its death watch blocks one for its whole life.
_ACTOR_CONCURRENCY = 4
# How long the death watch waits per round, and a failed restore before it tries again.
_WATCH_S = 0.5
_RESTORE_RETRY_S = 5.0
_STOP_GRACE_S = 20.0


def ray_address(cluster: str) -> str:
    """`--cluster`'s value as `ray.init`'s address ("local": a new cluster on this host)."""
    if cluster == "ray":
        return os.environ.get("RAY_ADDRESS") or "auto"
    if cluster.startswith("ray://"):
        return cluster
    if cluster.startswith("ray:") and len(cluster) > len("ray:"):
        return cluster.removeprefix("ray:")
    raise ValueError(
        f"--cluster: expected ray, ray:local, ray:ADDRESS or ray://HOST:PORT, got {cluster!r}"
    )


def parse_resources(text: str | None, where: str) -> dict[str, float]:
    """A pool's Ray resources from JSON (``{"CPU": 1, "GPU": 1, "my_node_kind": 1}``); one CPU
    unless it says otherwise."""
    if text is None:
        return dict(DEFAULT_RESOURCES)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict) or not all(
        isinstance(amount, int | float) and not isinstance(amount, bool) and amount >= 0
        for amount in value.values()
    ):
        raise ValueError(
            f"{where}: expected a JSON object of resource amounts, e.g. '{{\"CPU\": 1}}', "
            f"got {text!r}"
        )
    return {**DEFAULT_RESOURCES, **{name: float(amount) for name, amount in value.items()}}


def actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options asking for `resources`."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {"num_cpus": resources["CPU"], "num_gpus": resources.get("GPU", 0)}
    if "memory" in resources:
        options["memory"] = resources["memory"]
    if custom:
        options["resources"] = custom
    return options


def num_threads(resources: Mapping[str, float]) -> int:
    """A worker's torch threads: the whole CPUs it asked for (at least one)."""
    return max(1, math.floor(resources["CPU"]))


@dataclass(frozen=True)
class RayPlan:
    """What each worker of a pool is started with (`from_deployment`)."""

    # role -> what makes the worker what it is (`DeploymentConfig.role_argv`), its other
    # flags (`DeploymentConfig.worker_argv`)
    role_argv: Mapping[str, tuple[str, ...]]
    argv: Mapping[str, tuple[str, ...]]
    resources: Mapping[str, Mapping[str, float]]  # role -> Ray resources
    kv_transport: str | None  # "auto", or "tcp" where the user asked for it; None: replicas
    startup_timeout_s: float
    strategy: str | None = None  # a key of PLACEMENT_STRATEGIES
    log_dir: str | None = None  # on each worker's node (default: its temporary directory)
    step_log: str | None = None
    secret: str | None = field(default=None, repr=False)
    kv_store_secrets: Mapping[str, str] = field(default_factory=dict, repr=False)

    def bundle(self, role: str) -> dict[str, float]:
        """The role's resources as a placement-group bundle (zero amounts left out)."""
        return {k: v for k, v in self.resources[role].items() if v > 0}

    @classmethod
    def from_deployment(cls, deployment: DeploymentConfig, secret: str | None) -> RayPlan:
        resources = {role: getattr(deployment, f"{role}_worker_resources") for role in ROLES}
        return cls(
            role_argv={role: tuple(deployment.role_argv(role)) for role in ROLES},
            argv={role: tuple(deployment.worker_argv(role)) for role in ROLES},
            resources={
                role: parse_resources(text, f"--{role}-worker-resources")
                for role, text in resources.items()
            },
            # Shared memory alone cannot cross nodes: "shm" (the default) becomes "auto".
            kv_transport=None
            if deployment.is_replicated
            else "tcp"
            if deployment.kv_transport == "tcp"
            else "auto",
            startup_timeout_s=deployment.startup_timeout_s,
            strategy=deployment.placement_strategy,
            log_dir=deployment.worker_log_dir,
            step_log=deployment.step_log,
            secret=secret,
            kv_store_secrets=kv_store_secrets(deployment),
        )


class WorkerHost:
    """One worker process on this actor's node (the class `RayProvisioner` runs as an actor).

    The process is started from a thread of this actor that lives exactly as long as the
    process, because Linux's parent-death signal follows the thread that started a child: it
    fires only when the actor's process is gone."""

    def __init__(self, name: str, role: str, plan: RayPlan, tls: FleetTLS | None = None) -> None:
        """`tls`: the worker's --fleet-tls credentials (it also checks its health with them)."""
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._exited = threading.Event()
        self._exit_code: int | None = None
        # Another worker's host on this node can choose the same free port at the same moment
        # (Ray nodes sharing a machine); the one that binds it second chooses again.
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._start(name, role, plan, tls, ray.util.get_node_ip_address())
            except PortTakenError:
                if attempt == PORT_ATTEMPTS - 1:
                    raise

    def _start(self, name: str, role: str, plan: RayPlan, tls: FleetTLS | None, host: str) -> None:
        """Start the worker on a free port of `host` (`PortTakenError`: another took it)."""
        log_dir = Path(plan.log_dir or Path(tempfile.gettempdir()) / "pdserve-ray")
        log_dir.mkdir(parents=True, exist_ok=True)
        port, threads = free_port(host), num_threads(plan.resources[role])
        command = worker_command(
            name,
            plan.role_argv[role],
            plan.argv[role],
            (host, port),
            threads,
            plan.step_log,
            node_argv=self._kv_flags(plan, host),
        )
        # Not pinned: Ray accounts for CPUs, it does not assign cores.
        log_path = log_dir / f"{name}.log"
        self.spec = WorkerSpec(name, role, port, (), command, log_path, host, tls is not None)
        self._group = worker_process(
            self.spec,
            plan.secret,
            plan.kv_store_secrets,
            env={"OMP_NUM_THREADS": str(threads)},
            fleet_tls=tls,
            death_signal=signal.SIGKILL,
            tls=tls.client_context() if tls is not None else None,
        )
        started: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(started,), name=name, daemon=True).start()
        started.result()

    def _kv_flags(self, plan: RayPlan, host: str) -> tuple[str, ...]:
        if plan.kv_transport is None:  # replicas move no KV
            return ()
        return (
            *("--kv-transport", plan.kv_transport, "--kv-host", host),
            *("--kv-node-id", self.node_id),
        )

    def _run(self, started: concurrent.futures.Future) -> None:
        try:
            self._group.start()
        except BaseException as error:
            started.set_exception(error)
            return
        started.set_result(None)
        self._exit_code = self._group.wait(self.spec.name)
        self._exited.set()

    def info(self) -> dict[str, Any]:
        return {"url": self.spec.url, "node_id": self.node_id, "log": str(self.spec.log_path)}

    def wait_healthy(self, timeout_s: float) -> dict[str, Any]:
        """`info()` once the worker answers /health (`WorkerStartupError` with its log tail
        if it exits or stays unhealthy)."""
        self._group.wait_healthy(timeout_s)
        return self.info()

    def wait_exit(self) -> int | None:
        """Block until the worker process exits: its exit code (the death watch's call)."""
        self._exited.wait()
        return self._exit_code

    def stop(self, grace_s: float) -> None:
        self._group.stop(grace_s)


@dataclass(frozen=True)
class _Launched:
    """A worker's actor, created; `ready` is the ref of its `wait_healthy()`."""

    name: str
    role: str
    actor: Any
    ready: Any
    bundle_index: int | None


@dataclass(frozen=True)
class _Placed:
    handle: WorkerHandle
    actor: Any  # the `WorkerHost` actor
    exited: Any  # ObjectRef of its `wait_exit()`: ready when the worker is gone
    bundle_index: int | None
    log: str


class RayProvisioner:
    """`Provisioner` over a Ray cluster (`ray.init` done); see the module docstring.

    Thread-safe: the router's event loop reads `workers()`, the autoscaler may start and stop
    workers, the death watch and restores run on their own threads."""

    def __init__(self, plan: RayPlan, ca: FleetCA | None = None) -> None:
        """`ca`: the deployment's --fleet-tls CA, which issues each worker's certificate here
        (its key stays in this process)."""
        import ray

        self._ray = ray
        self._plan = plan
        self._ca = ca
        self._host_class = ray.remote(WorkerHost)
        self._lock = threading.Lock()
        self._live: dict[str, _Placed] = {}
        self._next_index = {role: itertools.count() for role in ROLES}
        self._placement_group = None
        self._is_closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pdserve-ray-watch", daemon=True)

    # ---- Provisioner ----

    def start_worker(self, role: str) -> WorkerHandle:
        """One more worker of `role`, outside the placement group (its strategy as a hint)."""
        return self._await(self._launch(role, None))

    def stop_worker(self, name: str) -> None:
        with self._lock:
            placed = self._live.pop(name, None)  # gone from the watch: no replacement
        if placed is not None:
            self._stop([placed])

    def workers(self) -> list[WorkerHandle]:
        with self._lock:
            return [placed.handle for placed in self._live.values()]

    def can_start(self, role: str) -> bool:
        """Whether the cluster has the role's resources free (summed over nodes: a hint, Ray
        has the last word when it places the actor)."""
        available = self._ray.available_resources()
        return all(available.get(k, 0.0) >= v for k, v in self._plan.bundle(role).items())

    # ---- the deployment ----

    def start(self, num_prefill: int, num_decode: int) -> list[WorkerHandle]:
        """The first workers, all at once (their models load in parallel), in one placement
        group when the plan has a strategy; returns once every one is healthy, then watches
        them. On failure the ones started are stopped."""
        roles = ["prefill"] * num_prefill + ["decode"] * num_decode
        if self._plan.strategy is not None:
            self._placement_group = self._reserve(roles)
        launched = [
            self._launch(role, None if self._placement_group is None else index)
            for index, role in enumerate(roles)
        ]
        try:
            handles = [self._await(each) for each in launched]
        except BaseException:
            for each in launched:
                self._ray.kill(each.actor, no_restart=True)
            raise
        self._watcher.start()
        return handles

    def log_path(self, name: str) -> str | None:
        with self._lock:
            placed = self._live.get(name)
        return None if placed is None else placed.log

    def close(self) -> None:
        """Stop every worker, release the placement group; no replacement starts after."""
        self._is_closed.set()
        with self._lock:
            placed, self._live = list(self._live.values()), {}
        self._stop(placed)
        if self._watcher.is_alive():
            self._watcher.join(timeout=10)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)

    # ---- internals ----

    def _reserve(self, roles: Sequence[str]):
        from ray.util.placement_group import placement_group

        group = placement_group(
            [self._plan.bundle(role) for role in roles],
            strategy=PLACEMENT_STRATEGIES[self._plan.strategy],
        )
        try:
            self._ray.get(group.ready(), timeout=self._plan.startup_timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)
            raise WorkerStartupError(
                f"the cluster could not place {len(roles)} workers "
                f"({self._plan.strategy}) in {self._plan.startup_timeout_s:.0f}s: "
                f"prefill needs {self._plan.bundle('prefill')}, decode "
                f"{self._plan.bundle('decode')}"
            ) from None
        return group

    def _launch(self, role: str, bundle_index: int | None) -> _Launched:
        """Create a worker's actor (in placement-group bundle `bundle_index`, if not None)."""
        with self._lock:
            name = f"{role}-{next(self._next_index[role])}"
        options = actor_options(self._plan.resources[role])
        if bundle_index is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._placement_group, placement_group_bundle_index=bundle_index
            )
        elif self._plan.strategy in ("spread", "strict_spread"):
            options["scheduling_strategy"] = "SPREAD"
        actor = self._host_class.options(
            name=name, max_concurrency=_ACTOR_CONCURRENCY, max_restarts=0, **options
        ).remote(name, role, self._plan, self._ca.issue(name) if self._ca is not None else None)
        ready = actor.wait_healthy.remote(self._plan.startup_timeout_s)
        return _Launched(name, role, actor, ready, bundle_index)

    def _await(self, launched: _Launched) -> WorkerHandle:
        """The launched worker's handle once it is healthy (and watched)."""
        ray, name, actor = self._ray, launched.name, launched.actor
        try:
            # Placement waits for resources; then the worker has its own startup timeout.
            info = ray.get(launched.ready, timeout=self._plan.startup_timeout_s + 30)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise WorkerStartupError(
                f"{name} was not placed and healthy within {self._plan.startup_timeout_s:.0f}s: "
                f"does the cluster have {self._plan.bundle(launched.role)} free?"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            ray.kill(actor, no_restart=True)
            raise WorkerStartupError(f"{name}: {exc.cause}") from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerStartupError(f"{name}'s actor died during startup: {exc}") from None
        handle = WorkerHandle(name, launched.role, info["url"], info["node_id"])
        exited = actor.wait_exit.remote()
        with self._lock:
            is_closing = self._is_closed.is_set()
            if not is_closing:
                self._live[name] = _Placed(
                    handle, actor, exited, launched.bundle_index, info["log"]
                )
        if is_closing:
            ray.kill(actor, no_restart=True)
            raise WorkerStartupError(f"{name}: the deployment is closing")
        logger.info(
            "%s worker %s on node %s at %s", launched.role, name, handle.node_id, handle.url
        )
        return handle

    def _stop(self, placed: Sequence[_Placed]) -> None:
        """Stop the workers (SIGTERM, then SIGKILL after the grace) and end their actors."""
        ray = self._ray
        stopping = [p.actor.stop.remote(_STOP_GRACE_S) for p in placed]
        if stopping:
            ray.wait(stopping, num_returns=len(stopping), timeout=_STOP_GRACE_S + 10)
        for p in placed:
            ray.kill(p.actor, no_restart=True)

    def _watch(self) -> None:
        """Until closed: a watched worker that is gone leaves `workers()` and is replaced."""
        ray = self._ray
        while not self._is_closed.is_set():
            with self._lock:
                watched = {placed.exited: placed for placed in self._live.values()}
            if not watched:
                self._is_closed.wait(_WATCH_S)
                continue
            gone, _ = ray.wait(list(watched), num_returns=1, timeout=_WATCH_S)
            for ref in gone:
                placed = watched[ref]
                with self._lock:
                    if self._live.get(placed.handle.name) is not placed:
                        continue  # stopped on purpose meanwhile
                    del self._live[placed.handle.name]
                self._on_death(placed, ref)

    def _on_death(self, placed: _Placed, exited: Any) -> None:
        ray = self._ray
        try:
            reason = f"its process exited with code {ray.get(exited)}"
            ray.kill(placed.actor, no_restart=True)  # give its resources back
        except ray.exceptions.RayActorError:
            reason = "its actor died (its node was lost, or it was killed)"
        handle = placed.handle
        logger.warning(
            "%s worker %s on node %s is gone: %s; starting a replacement",
            handle.role,
            handle.name,
            handle.node_id,
            reason,
        )
        threading.Thread(
            target=self._restore,
            args=(handle.role, placed.bundle_index),
            name=f"restore-{handle.name}",
            daemon=True,
        ).start()

    def _restore(self, role: str, bundle_index: int | None) -> None:
        """Start a `role` worker (in the lost one's bundle, which Ray re-places on a live
        node), retrying until one is healthy or the deployment closes."""
        while not self._is_closed.is_set():
            try:
                handle = self._await(self._launch(role, bundle_index))
            except WorkerStartupError as exc:
                if self._is_closed.is_set():
                    return
                logger.warning("could not restore a %s worker yet: %s", role, exc)
                self._is_closed.wait(_RESTORE_RETRY_S)
                continue
            logger.warning("%s pool restored: %s on node %s", role, handle.name, handle.node_id)
            return


def connect(address: str, namespace: str) -> None:
    """Join the cluster at `address` (or start a private one: "local"), quietly."""
    import ray

    options: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
    if address == "local":
        options.update(include_dashboard=False, num_cpus=len(os.sched_getaffinity(0)))
    ray.init(address=address, **options)


def require_ray() -> None:
    """Ray importable, or MissingExtraError saying how to install it (it is an extra)."""
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "ray":  # Ray is there but broken: its own error says why
            raise
        raise MissingExtraError(
            "--cluster ray needs Ray, which is not installed: pip install 'pdserve[ray]'"
        ) from None


def launch_on_ray(deployment: DeploymentConfig) -> int:
    """Run the deployment on the cluster until SIGINT/SIGTERM; 0 after a clean stop, 1 if
    its workers could not start."""
    require_ray()
    roles = deployment.initial_roles()  # within the --autoscale bounds
    address = ray_address(deployment.cluster)
    secret, ca = fleet_membership(deployment)
    plan = RayPlan.from_deployment(deployment, secret)
    config = deployment.router_config(
        (), (), secret, ca.issue("router") if ca is not None else None
    )
    import ray

    connect(address, namespace=f"pdserve-{secrets.token_hex(4)}")
    provisioner = RayProvisioner(plan, ca)

    def start() -> None:
        for handle in provisioner.start(roles.count("prefill"), roles.count("decode")):
            print(
                f"pdserve {deployment.mode.value}: {handle.name} on {handle.url}, "
                f"Ray node {handle.node_id}, "
                f"log {provisioner.log_path(handle.name)} (on that node)",
                file=sys.stderr,
                flush=True,
            )

    def stop() -> None:
        started = time.monotonic()
        provisioner.close()
        ray.shutdown()
        logger.info("deployment stopped in %.1fs", time.monotonic() - started)

    return run_deployment(
        deployment,
        config,
        start,
        stop,
        provisioner,
        deployment.autoscale,
        discover=provisioner.workers,
    )
