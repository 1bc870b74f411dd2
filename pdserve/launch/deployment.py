"""What every deployment behind a router shares (`--mode disagg`, or replicas of
`--mode colocated|chunked --data-parallel-size N`), on one host or on a cluster.

`WORKER_FLAGS`, the flags a worker is started with (`DeploymentConfig.worker_flags` holds
their values from the command line); each worker's own step log and secrets; and
`run_deployment`, which starts the workers, runs the router in this process until
SIGINT/SIGTERM and stops them. The one-host launcher (`launch.local`) and the Ray placement
(`launch.ray_cluster`) both build on it; `launch.cli` picks between them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from pdserve.engine.args import ENGINE_FLAGS, KV_STORE_FLAGS, KV_TRANSFER_FLAGS
from pdserve.fleet import FLEET_SECRET_ENV, FLEET_TLS_ENV, FleetCA, FleetTLS, deployment_secret
from pdserve.kv_store.config import (
    KV_STORE_NAMESPACE_SECRET_ENV,
    KV_STORE_PASSWORD_ENV,
    read_namespace_secret,
    read_password,
    split_password,
)
from pdserve.launch.config import DeploymentConfig
from pdserve.launch.worker_group import WorkerGroup, WorkerSpec, WorkerStartupError
from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.cli import serve_router
from pdserve.router.config import RouterConfig
from pdserve.router.provision import Provisioner
from pdserve.router.runtime import Discover
from pdserve.router.tokenizer import LocalTokenizer, PromptTokenizer
from pdserve.server.cli import SERVER_FLAGS

logger = logging.getLogger("pdserve.launch")

WORKER_HOST = "127.0.0.1"

# Set by the launcher for each worker (its role, address, threads and step log) or kept for
# the router (the mode, the API key: workers listen on loopback behind it) or the launcher
# (the store's secrets' files: workers get the secrets in their environment).
PER_WORKER_FLAGS = frozenset(
    {
        *("--mode", "--host", "--port", "--api-key", "--role", "--num-threads", "--step-log"),
        *("--kv-store-password-file", "--kv-store-namespace-secret-file"),
    }
)
# What every worker of a deployment is started with, where the user gave it: the server's
# limits, the engine's flags, the KV transfer's and the KV store's. The disaggregation and
# routing flags are the launcher's and the router's alone.
WORKER_FLAGS = tuple(
    option
    for option in (*SERVER_FLAGS, *ENGINE_FLAGS, *KV_TRANSFER_FLAGS, *KV_STORE_FLAGS)
    if option.name not in PER_WORKER_FLAGS
)


def kv_store_secrets(deployment: DeploymentConfig) -> dict[str, str]:
    """The store's secrets a deployment's workers get in their environment (by variable),
    never in argv: its password (the URL's, the file's or `$PDSERVE_KV_STORE_PASSWORD`) and
    its namespace's secret."""
    if deployment.kv_store is None:
        return {}
    password = split_password(deployment.kv_store)[1]
    if password is None:
        password = read_password(deployment.kv_store_password_file)
    else:
        logger.warning(
            "--kv-store's password is in this process's argv, which every user of the host "
            "can read; give it in $%s or --kv-store-password-file (workers get it in their "
            "environment either way)",
            KV_STORE_PASSWORD_ENV,
        )
    secrets = {
        KV_STORE_PASSWORD_ENV: password,
        KV_STORE_NAMESPACE_SECRET_ENV: read_namespace_secret(
            deployment.kv_store_namespace_secret_file
        ),
    }
    return {name: value for name, value in secrets.items() if value}


# Every secret a launcher hands its workers, in their environment: none inherited from it.
WORKER_SECRETS = (
    FLEET_SECRET_ENV,
    *FLEET_TLS_ENV,
    KV_STORE_PASSWORD_ENV,
    KV_STORE_NAMESPACE_SECRET_ENV,
)


def worker_secrets(
    fleet_secret: str | None,
    kv_store_secrets: Mapping[str, str],
    fleet_tls: FleetTLS | None = None,
) -> dict[str, str]:
    """The environment that carries a worker's secrets (never its argv): the fleet secret
    and its TLS credentials (`pdserve.fleet`) and the store's (`kv_store_secrets`)."""
    return {
        **kv_store_secrets,
        **({FLEET_SECRET_ENV: fleet_secret} if fleet_secret else {}),
        **(fleet_tls.to_env() if fleet_tls is not None else {}),
    }


def fleet_membership(deployment: DeploymentConfig) -> tuple[str | None, FleetCA | None]:
    """The deployment's fleet secret (`pdserve.fleet`: by default on a cluster, off on one
    host; always with --fleet-tls) and, with --fleet-tls, the CA its launcher makes."""
    if deployment.fleet_tls and deployment.worker_auth is False:
        raise ValueError("--fleet-tls encrypts a guarded deployment: drop --no-worker-auth")
    is_cluster = deployment.cluster is not None
    is_guarded = is_cluster if deployment.worker_auth is None else deployment.worker_auth
    secret = deployment_secret() if is_guarded or deployment.fleet_tls else None
    return secret, FleetCA() if deployment.fleet_tls else None


def worker_command(
    name: str,
    role_argv: Sequence[str],
    argv: Sequence[str],
    address: tuple[str, int],
    num_threads: int,
    step_log: str | None,
    node_argv: Sequence[str] = (),
) -> tuple[str, ...]:
    """One worker's ``pdserve serve`` command: what makes it what it is (`role_argv`), its
    address and threads, the deployment's flags for it (`argv`), its own step log, then
    `node_argv`, flags of the node it runs on (they win: they come last)."""
    host, port = address
    return (
        *(sys.executable, "-m", "pdserve.cli", "serve", *role_argv),
        *("--host", host, "--port", str(port), "--num-threads", str(num_threads)),
        *argv,
        *step_log_flags(step_log, name),
        *node_argv,
    )


def worker_process(
    spec: WorkerSpec,
    fleet_secret: str | None,
    kv_store_secrets: Mapping[str, str],
    env: Mapping[str, str] | None = None,
    fleet_tls: FleetTLS | None = None,
    **options,
) -> WorkerGroup:
    """The process of one worker: its secrets in its environment (`worker_secrets`: with
    --fleet-tls its own certificate too), besides `env`, and none this process holds (nor the
    user's API key: workers answer only the router, which checks it); `options` as
    `WorkerGroup` takes them."""
    return WorkerGroup(
        [spec],
        unset_env=("PDSERVE_API_KEY", *WORKER_SECRETS),
        env={**(env or {}), **worker_secrets(fleet_secret, kv_store_secrets, fleet_tls)},
        **options,
    )


def run_deployment(
    deployment: DeploymentConfig,
    config: RouterConfig,
    start: Callable[[], None],
    stop: Callable[[], None],
    provisioner: Provisioner | None = None,
    autoscale: AutoscaleConfig | None = None,
    discover: Discover | None = None,
) -> int:
    """`start` the workers (returns once all are healthy, or raises `WorkerStartupError`), run
    the router in this process until SIGINT/SIGTERM, and `stop` them whatever happened; 0
    after a clean stop, 1 if startup failed. `provisioner`, `autoscale` and `discover` as
    `router.runtime.RouterRuntime` takes them."""
    with _sigterm_raises_shutdown():
        try:
            tokenizer = (
                _load_tokenizer_while(start, deployment.model)
                if config.needs_token_ids
                else start()
            )
            mode = deployment.mode.value
            print(f"pdserve {mode}: serving on http://{config.host}:{config.port}", flush=True)
            serve_router(config, tokenizer, provisioner, autoscale, discover)
        except WorkerStartupError as exc:
            print(f"pdserve serve --mode disagg: {exc}", file=sys.stderr)
            return 1
        except _Shutdown:
            pass
        finally:
            stop()
    return 0


def step_log_flags(path: str | None, worker_name: str) -> list[str]:
    """Each worker logs its steps to its own file: steps.jsonl -> steps.prefill-0.jsonl."""
    if path is None:
        return []
    path = Path(path)
    return ["--step-log", str(path.with_name(f"{path.stem}.{worker_name}{path.suffix}"))]


def _load_tokenizer_while(wait: Callable[[], None], model: str | None) -> PromptTokenizer | None:
    """Load the router's tokenizer while `wait` (workers starting) runs; on failure the router
    asks the workers' /tokenize instead."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        loading = pool.submit(LocalTokenizer.load, model)
        wait()
        try:
            return loading.result()
        except ValueError as exc:
            logger.warning("router tokenizer: %s; asking the workers' /tokenize", exc)
            return None


class _Shutdown(Exception):
    """SIGTERM arrived: unwind, stopping every child on the way."""


@contextlib.contextmanager
def _sigterm_raises_shutdown() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise _Shutdown

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
