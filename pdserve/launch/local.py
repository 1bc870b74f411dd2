"""One-command disaggregated serving on one host: `pdserve serve --mode disagg`.

`launch_disagg(args)` starts N prefill and M decode workers (``pdserve serve --role ...``) as
separate processes, each pinned to its own cores with one torch thread per core, waits until
all answer /health, then runs the router in this process until SIGINT/SIGTERM and stops every
child. A worker that dies during startup stops the rest; the launcher exits 1 with its log tail.
Workers get the flags `launch.cli.worker_argv` gives them, plus their own role, loopback
address, thread count and step log (one file per worker, named after it), and with
`--worker-auth` the deployment's fleet secret in their environment (`launch.fleet`).
`run_deployment` is the part every launcher shares (the Ray one too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pdserve.launch.cli import worker_argv
from pdserve.launch.fleet import FLEET_SECRET_ENV, deployment_secret
from pdserve.launch.worker_group import WorkerGroup, WorkerSpec, WorkerStartupError
from pdserve.router.cli import router_config_from_args, serve_router
from pdserve.router.config import RouterConfig
from pdserve.router.runtime import Discover
from pdserve.router.tokenizer import LocalTokenizer, PromptTokenizer

logger = logging.getLogger("pdserve.launch")

WORKER_HOST = "127.0.0.1"


def launch_disagg(args: argparse.Namespace) -> int:
    """Run the deployment until SIGINT/SIGTERM; 0 after a clean stop, 1 if startup failed."""
    specs = plan_workers(args)
    # Workers listen on loopback, so a secret is opt-in here (--worker-auth).
    secret = deployment_secret() if args.worker_auth else None
    config = router_config_from_args(
        args,
        [s.url for s in specs if s.role == "prefill"],
        [s.url for s in specs if s.role == "decode"],
        secret,
    )
    # Workers listen behind the router, which alone checks the API key.
    group = WorkerGroup(
        specs,
        unset_env=("PDSERVE_API_KEY", FLEET_SECRET_ENV),
        env={FLEET_SECRET_ENV: secret} if secret else None,
    )
    _print_plan(specs)

    def start() -> None:
        group.start()
        group.wait_healthy(args.startup_timeout)

    return run_deployment(args, config, start, group.stop)


def run_deployment(
    args: argparse.Namespace,
    config: RouterConfig,
    start: Callable[[], None],
    stop: Callable[[], None],
    discover: Discover | None = None,
) -> int:
    """`start` the workers (returns once all are healthy, or raises `WorkerStartupError`), run
    the router in this process until SIGINT/SIGTERM, and `stop` them whatever happened; 0
    after a clean stop, 1 if startup failed."""
    with _sigterm_raises_shutdown():
        try:
            tokenizer = (
                _load_tokenizer_while(start, args.model) if config.needs_token_ids else start()
            )
            print(f"pdserve disagg: serving on http://{config.host}:{config.port}", flush=True)
            serve_router(config, tokenizer, discover)
        except WorkerStartupError as exc:
            print(f"pdserve serve --mode disagg: {exc}", file=sys.stderr)
            return 1
        except _Shutdown:
            pass
        finally:
            stop()
    return 0


def plan_workers(args: argparse.Namespace) -> list[WorkerSpec]:
    """Prefill workers then decode workers: ports, cores, commands and log files."""
    num_prefill, num_decode = args.prefill_workers, args.decode_workers
    if num_prefill < 0 or num_decode < 1:
        raise ValueError("--decode-workers must be >= 1 and --prefill-workers >= 0")
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    cores = assign_cores(sorted(os.sched_getaffinity(0)), len(roles))
    ports = _worker_ports(args.worker_base_port, len(roles))
    log_dir = Path(args.worker_log_dir or tempfile.mkdtemp(prefix="pdserve-disagg-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = {role: worker_argv(args, role) for role in set(roles)}
    specs, counts = [], {"prefill": 0, "decode": 0}
    for role, port, worker_cores in zip(roles, ports, cores, strict=True):
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        command = (
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--role",
            role,
            "--host",
            WORKER_HOST,
            "--port",
            str(port),
            "--num-threads",
            str(len(worker_cores)),
            *flags[role],
            *step_log_flags(args.step_log, name),
        )
        specs.append(WorkerSpec(name, role, port, worker_cores, command, log_dir / f"{name}.log"))
    return specs


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


def step_log_flags(path: str | None, worker_name: str) -> list[str]:
    """Each worker logs its steps to its own file: steps.jsonl -> steps.prefill-0.jsonl."""
    if path is None:
        return []
    path = Path(path)
    return ["--step-log", str(path.with_name(f"{path.stem}.{worker_name}{path.suffix}"))]


def _worker_ports(base_port: int | None, count: int) -> list[int]:
    if base_port is not None:
        return [base_port + i for i in range(count)]
    return [free_port() for _ in range(count)]


def free_port(host: str = WORKER_HOST) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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


def _print_plan(specs: list[WorkerSpec]) -> None:
    for spec in specs:
        cores = ",".join(map(str, spec.cores))
        print(
            f"pdserve disagg: {spec.name} on {spec.url}, cores {cores}, log {spec.log_path}",
            file=sys.stderr,
            flush=True,
        )


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
