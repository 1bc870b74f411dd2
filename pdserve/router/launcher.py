"""One-command disaggregated serving on one host: `pdserve serve --mode disagg`.

`launch_disagg(args)` starts N prefill and M decode workers (``pdserve serve --role ...``) as
separate processes, each pinned to its own cores with one torch thread per core, waits until
all answer /health, then runs the router in this process until SIGINT/SIGTERM and stops every
child. A worker that dies during startup stops the rest; the launcher exits 1 with its log tail.

Workers get every engine/server flag the user gave `pdserve serve` (introspected from the
serve parser) except the ones the launcher owns: mode, host, port, api key, threads, the
step log (one file per worker, named after it), and the disaggregation flags below (but
--kv-transport, which workers need).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import shlex
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from pdserve.router.cli import (
    add_once,
    add_routing_args,
    router_config_from_args,
    serve_router,
)
from pdserve.router.cores import assign_cores
from pdserve.router.tokenizer import LocalTokenizer, PromptTokenizer
from pdserve.router.worker_group import WorkerGroup, WorkerSpec, WorkerStartupError

logger = logging.getLogger("pdserve.router")

WORKER_HOST = "127.0.0.1"
KV_TRANSPORTS = ("shm", "tcp")
# Serve flags the launcher sets per worker itself, or keeps for the router.
_NOT_FORWARDED = frozenset(
    {
        "help",
        "mode",
        "host",
        "port",
        "api_key",
        "role",
        "num_threads",
        "run",
        "command",
        "log_level",
        "step_log",
    }
)
# Disaggregation flags workers need too.
_WORKER_DISAGG_FLAGS = frozenset({"kv_transport"})


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve serve --mode disagg``, plus the router's routing flags. A flag the
    parser already has (e.g. a worker's --kv-transport) is left as it is."""
    group = parser.add_argument_group("disaggregated serving (--mode disagg)")
    add_once(group, "--prefill-workers", type=int, default=1)
    add_once(group, "--decode-workers", type=int, default=1)
    add_once(
        group,
        "--kv-transport",
        choices=KV_TRANSPORTS,
        default="shm",
        help="how KV blocks move between workers: shared memory (same host) or TCP",
    )
    add_once(
        group,
        "--worker-base-port",
        type=int,
        default=None,
        help="workers listen on consecutive ports from here (default: free ports)",
    )
    add_once(
        group,
        "--worker-log-dir",
        default=None,
        help="one log file per worker (default: a new temporary directory)",
    )
    add_once(group, "--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    add_once(
        group,
        "--worker-args",
        default="",
        help="extra flags for every worker, one shell-quoted string",
    )
    # One pool's flags come after --worker-args, so they win.
    add_once(
        group,
        "--prefill-worker-args",
        default="",
        metavar="FLAGS",
        help="extra flags for prefill workers only, e.g. '--max-num-batched-tokens 2048'",
    )
    add_once(
        group,
        "--decode-worker-args",
        default="",
        metavar="FLAGS",
        help="extra flags for decode workers only, e.g. '--max-num-batched-tokens 128' "
        "to chunk their local prefills finely",
    )
    add_routing_args(parser)


def launch_disagg(args: argparse.Namespace) -> int:
    """Run the deployment until SIGINT/SIGTERM; 0 after a clean stop, 1 if startup failed."""
    specs = plan_workers(args)
    config = router_config_from_args(
        args,
        [s.url for s in specs if s.role == "prefill"],
        [s.url for s in specs if s.role == "decode"],
    )
    # Workers listen on loopback behind the router, which alone checks the API key.
    group = WorkerGroup(specs, unset_env=("PDSERVE_API_KEY",))
    _print_plan(specs)
    with _sigterm_raises_shutdown():
        try:
            group.start()
            wait = lambda: group.wait_healthy(args.startup_timeout)  # noqa: E731
            tokenizer = (
                _load_tokenizer_while(wait, getattr(args, "model", None))
                if config.needs_token_ids
                else wait()
            )
            print(f"pdserve disagg: serving on http://{config.host}:{config.port}", flush=True)
            serve_router(config, tokenizer)
        except WorkerStartupError as exc:
            print(f"pdserve serve --mode disagg: {exc}", file=sys.stderr)
            return 1
        except _Shutdown:
            pass
        finally:
            group.stop()
    return 0


def plan_workers(
    args: argparse.Namespace, serve_parser: argparse.ArgumentParser | None = None
) -> list[WorkerSpec]:
    """Prefill workers then decode workers: ports, cores, commands and log files."""
    num_prefill, num_decode = args.prefill_workers, args.decode_workers
    if num_prefill < 0 or num_decode < 1:
        raise ValueError("--decode-workers must be >= 1 and --prefill-workers >= 0")
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    cores = assign_cores(sorted(os.sched_getaffinity(0)), len(roles))
    ports = _worker_ports(args.worker_base_port, len(roles))
    log_dir = Path(args.worker_log_dir or tempfile.mkdtemp(prefix="pdserve-disagg-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shared = worker_flags(args, serve_parser) + shlex.split(args.worker_args)
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
            *shared,
            *shlex.split(getattr(args, f"{role}_worker_args", "")),
            *_step_log_flags(getattr(args, "step_log", None), name),
        )
        specs.append(WorkerSpec(name, role, port, worker_cores, command, log_dir / f"{name}.log"))
    return specs


def _step_log_flags(path: str | None, worker_name: str) -> list[str]:
    """Each worker logs its steps to its own file: steps.jsonl -> steps.prefill-0.jsonl."""
    if path is None:
        return []
    path = Path(path)
    return ["--step-log", str(path.with_name(f"{path.stem}.{worker_name}{path.suffix}"))]


def worker_flags(
    args: argparse.Namespace, serve_parser: argparse.ArgumentParser | None = None
) -> list[str]:
    """The flags of `args` that differ from `serve_parser`'s defaults and belong to workers."""
    parser = serve_parser if serve_parser is not None else _serve_parser()
    launcher_only = _dests(add_disagg_args) - _WORKER_DISAGG_FLAGS
    flags: list[str] = []
    for action in parser._actions:  # argparse has no public listing of a parser's options
        dest = action.dest
        if not action.option_strings or dest in _NOT_FORWARDED or dest in launcher_only:
            continue
        value = getattr(args, dest, action.default)
        if value == action.default:
            continue
        flags += _as_flags(action, value)
    return flags


def _as_flags(action: argparse.Action, value: object) -> list[str]:
    flag = action.option_strings[-1]
    if action.nargs == 0:  # store_true / store_false / store_const
        return [flag]
    if isinstance(value, list | tuple):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def _serve_parser() -> argparse.ArgumentParser:
    from pdserve.server.cli import add_parser

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_parser(subparsers)
    return subparsers.choices["serve"]


def _dests(add_args: Callable[[argparse.ArgumentParser], None]) -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return {action.dest for action in parser._actions}


def _worker_ports(base_port: int | None, count: int) -> list[int]:
    if base_port is not None:
        return [base_port + i for i in range(count)]
    return [_free_port() for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((WORKER_HOST, 0))
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
