"""`DeploymentConfig`: a deployment behind a router, typed, as `pdserve serve`'s command line
gives it (`launch.cli.deployment_config_from_args`, the one parse of its flags). The one-host
launcher, its `LocalProvisioner`, the Ray plan and `run_deployment` read only this.

Every default is its field's; the launcher's flags (`launch.cli`) read theirs from here and
carry the field's name as their `dest`.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from pdserve.core.config import Mode
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.config import RouterConfig
from pdserve.router.policies import PoolRole

# Flags that place workers on a cluster: given without --cluster they are a mistake.
CLUSTER_ONLY_FIELDS = ("prefill_worker_resources", "decode_worker_resources", "placement_strategy")


@dataclass(frozen=True)
class DeploymentConfig:
    """`--mode disagg` (prefill and decode pools) or replicas of `--mode colocated|chunked
    --data-parallel-size N` (the router's decode pool), on this host's cores or, with
    `cluster`, on a Ray cluster."""

    mode: Mode
    # The router in front: its routing flags, address and key; no worker URLs and no fleet
    # secret (each launcher adds its own: `router_config`).
    router: RouterConfig
    # What every worker is started with, besides its role, address, threads and step log:
    # the arguments of the `WORKER_FLAGS` the user gave (`launch.deployment`), the store's
    # password left out (workers get it in their environment).
    worker_flags: tuple[str, ...] = ()
    # None: fixed pools.
    autoscale: AutoscaleConfig | None = None
    # The engine's, as far as the launcher needs them: the router's tokenizer, the workers'
    # step logs, their KV transport (Ray makes "shm" "auto"), the store's secrets' sources.
    model: str | None = EngineConfig.model
    step_log: str | None = EngineConfig.step_log
    kv_transport: str = KVTransferConfig.transport
    kv_store: str | None = None  # its URL, password and all
    kv_store_password_file: str | None = None
    kv_store_namespace_secret_file: str | None = None
    # The pools (`--mode disagg`) or the replicas.
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    data_parallel_size: int = 1
    # Shell-quoted flags for every worker, then for one pool's (they win: they come later).
    worker_args: str = ""
    prefill_worker_args: str = ""
    decode_worker_args: str = ""
    # Consecutive ports from here (None: free ports); one host only.
    worker_base_port: int | None = None
    worker_log_dir: str | None = None  # None: a new temporary directory
    startup_timeout_s: float = 600.0
    # "ray", "ray:local" or "ray:ADDRESS" (None: this host's cores, no Ray), and what each
    # pool's workers ask Ray for (JSON; None: one CPU).
    cluster: str | None = None
    prefill_worker_resources: str | None = None
    decode_worker_resources: str | None = None
    placement_strategy: str | None = None
    # A fleet secret guards the workers (None: on with a cluster, off on one host).
    worker_auth: bool | None = None

    def __post_init__(self) -> None:
        if self.cluster is None:
            for name in CLUSTER_ONLY_FIELDS:
                if getattr(self, name) is not None:
                    flag_name = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag_name} places workers on a cluster: give --cluster too")
        elif self.worker_base_port is not None:
            raise ValueError(
                "--worker-base-port is for one host; on a cluster each worker takes a free port "
                "on its node"
            )
        if not self.is_replicated and (self.num_prefill_workers < 0 or self.num_decode_workers < 1):
            raise ValueError("--decode-workers must be >= 1 and --prefill-workers >= 0")

    @property
    def is_replicated(self) -> bool:
        """Whether the workers are replicas (whole servers of `mode`), not the pools of a
        disaggregated deployment."""
        return self.mode is not Mode.DISAGG

    def role_argv(self, role: str) -> list[str]:
        """What makes a worker what it is: a replica is a plain server of the deployment's
        mode, a disaggregated worker a `--role prefill|decode` server."""
        return ["--mode", self.mode.value] if self.is_replicated else ["--role", role]

    def worker_argv(self, role: str) -> list[str]:
        """The flags each `role` worker is started with besides its role, address, threads
        and step log: `worker_flags`, then --worker-args, then the pool's own (a disaggregated
        worker's; the last of a flag given twice wins)."""
        pool_args = "" if self.is_replicated else getattr(self, f"{role}_worker_args")
        return [*self.worker_flags, *shlex.split(self.worker_args), *shlex.split(pool_args)]

    def initial_roles(self) -> list[str]:
        """Prefill workers then decode workers; with `autoscale` within the pools' bounds.
        Replicas serve whole requests: they are the router's decode pool."""
        if self.is_replicated:
            return ["decode"] * self.data_parallel_size
        num_prefill, num_decode = self.num_prefill_workers, self.num_decode_workers
        if self.autoscale is not None:
            num_prefill = self.autoscale.clamp(PoolRole.PREFILL, num_prefill)
            num_decode = self.autoscale.clamp(PoolRole.DECODE, num_decode)
        return ["prefill"] * num_prefill + ["decode"] * num_decode

    def router_config(
        self, prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], fleet_secret: str | None
    ) -> RouterConfig:
        """The router in front of these workers (none: the launcher's discovery finds them)."""
        return dataclasses.replace(
            self.router,
            prefill_urls=tuple(prefill_urls),
            decode_urls=tuple(decode_urls),
            fleet_secret=fleet_secret,
        )
