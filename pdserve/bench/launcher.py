"""Start a server as a child process, wait until it is healthy, and stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.ports import free_port
from pdserve.redaction import redact_argv
from pdserve.workload.errors import BenchError

# Placeholders: {python} (this interpreter), {mode}, {host}, {port}.
DEFAULT_SERVER_COMMAND = (
    "{python}",
    "-m",
    "pdserve.cli",
    "serve",
    "--mode",
    "{mode}",
    "--host",
    "{host}",
    "--port",
    "{port}",
)
_POLL_S = 0.25
_LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class LaunchConfig:
    """How to start one server per mode.

    `command` is an argv template (see DEFAULT_SERVER_COMMAND); `extra_args` are appended,
    with the same placeholders (e.g. a per-mode `--step-log steps-{mode}.jsonl`), then
    `mode_args[mode]`: one mode's own flags (e.g. its token budget), so that each mode can be
    compared at its best settings. The child's stdout and stderr go to
    `log_dir/server-MODE.log`.
    """

    command: tuple[str, ...] = DEFAULT_SERVER_COMMAND
    extra_args: tuple[str, ...] = ()
    mode_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    host: str = "127.0.0.1"
    health_path: str = "/health"
    health_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    log_dir: Path = Path(".")
    cwd: Path | None = None
    env: Mapping[str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.command:
            raise BenchError("--server-cmd is empty")
        if not self.health_timeout_s > 0:
            raise BenchError(f"--health-timeout must be > 0, got {self.health_timeout_s}")
        if not self.stop_grace_s >= 0:
            raise BenchError(f"--stop-grace must be >= 0, got {self.stop_grace_s}")

    def argv(self, mode: str, port: int, layout: Sequence[str] = ()) -> list[str]:
        """The command for one mode, placeholders filled in; `layout` (its engines, e.g.
        `--data-parallel-size 2`) before the mode's own args."""
        values = {"python": sys.executable, "mode": mode, "host": self.host, "port": str(port)}
        template = (*self.command, *self.extra_args, *layout, *self.mode_args.get(mode, ()))
        try:
            return [part.format(**values) for part in template]
        except (KeyError, IndexError, ValueError) as exc:
            raise BenchError(
                f"--server-cmd/--server-args: bad placeholder {exc} in "
                f"{shlex.join(redact_argv(template))!r}; "
                "use {python}, {mode}, {host}, {port}"
            ) from None


@dataclass
class RunningServer:
    """A started, healthy server."""

    mode: str
    base_url: str
    process: subprocess.Popen
    log_path: Path
    exit_code: int | None = None


@contextlib.contextmanager
def launch_server(
    config: LaunchConfig,
    mode: str,
    layout: Sequence[str] = (),
    cores: Sequence[int] | None = None,
) -> Iterator[RunningServer]:
    """Start the server for `mode` (with the `layout` flags, on `cores` only when given: it
    and every worker it starts), yield it once `GET /health` answers 200, stop it after.

    Stopping sends SIGTERM, waits `stop_grace_s`, then SIGKILLs the whole process group (the
    server and any workers it started). Raises BenchError, with the log's tail, when the
    server exits early or is not healthy in time.
    """
    port = free_port(config.host)
    config.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = config.log_dir / f"server-{mode}.log"
    argv = config.argv(mode, port, layout)
    pinned = None if cores is None else set(cores)
    with open(log_path, "wb") as log:
        try:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=config.cwd,
                env=None if config.env is None else dict(config.env),
                start_new_session=True,
                # The server's launcher cuts these cores into its workers' slots.
                preexec_fn=None if pinned is None else lambda: os.sched_setaffinity(0, pinned),
            )
        except OSError as exc:
            raise BenchError(f"cannot start {shlex.join(redact_argv(argv))!r}: {exc}") from exc
        server = RunningServer(mode, f"http://{config.host}:{port}", process, log_path)
        try:
            _wait_healthy(server, config)
            yield server
        finally:
            server.exit_code = stop_process(process, config.stop_grace_s)


def stop_process(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, wait up to `grace_s`, then SIGKILL the process group; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    # Also reaps workers the server left behind, which would hold ports and cores.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def _wait_healthy(server: RunningServer, config: LaunchConfig) -> None:
    url = server.base_url + config.health_path
    deadline = time.monotonic() + config.health_timeout_s
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline:
            code = server.process.poll()
            if code is not None:
                raise BenchError(
                    f"the {server.mode} server exited with code {code} before it was healthy "
                    f"({shlex.join(redact_argv(server.process.args))}); "
                    f"{_log_tail(server.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if http.get(url).status_code == 200:
                    return
            time.sleep(_POLL_S)
    raise BenchError(
        f"the {server.mode} server was not healthy ({url} != 200) within "
        f"{config.health_timeout_s:g} s; {_log_tail(server.log_path)}"
    )


def _log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    return f"last lines of {path}:\n" + "\n".join(lines) if lines else f"{path} is empty"
