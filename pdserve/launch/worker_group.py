"""Worker processes of a one-host disaggregated deployment: start pinned, await health, stop.

Each child runs in its own session (Ctrl-C reaches only the launcher, which stops the children
in order), is pinned to its cores before it executes anything, and gets SIGTERM (or the
group's `death_signal`) if the launcher dies without cleaning up (Linux parent-death signal,
which follows the thread that started the child).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.server.cli import LISTEN_FD_ENV

_PR_SET_PDEATHSIG = 1
# Loaded before any fork: the child must not dlopen between fork and exec.
_LIBC = ctypes.CDLL(None, use_errno=True)
_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # "prefill-0", "decode-1", ...
    role: str
    port: int
    cores: tuple[int, ...]
    command: tuple[str, ...]
    log_path: Path
    host: str = "127.0.0.1"
    is_tls: bool = False  # --fleet-tls: it serves HTTPS

    @property
    def url(self) -> str:
        return f"{'https' if self.is_tls else 'http'}://{self.host}:{self.port}"


class WorkerStartupError(RuntimeError):
    """A worker exited or stayed unhealthy during startup; the message ends with its log."""


class PortTakenError(WorkerStartupError):
    """A worker's port was bound by another process before the worker started."""


class WorkerGroup:
    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        unset_env: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        death_signal: signal.Signals = signal.SIGTERM,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`unset_env`: variables of this process the workers must not inherit; `env`: ones
        they get besides, or instead of the group's own (the fleet secret goes here: never in
        argv, which every local user can read). Workers with no cores are not pinned. `tls`:
        how health checks reach --fleet-tls workers (a member's client context)."""
        self.specs = list(specs)
        self._tls = tls
        self._unset_env = frozenset(unset_env)
        self._env = dict(env or {})
        self._death_signal = death_signal
        self._processes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        inherited = {k: v for k, v in os.environ.items() if k not in self._unset_env}
        for spec in self.specs:
            env = {
                **inherited,
                "OMP_NUM_THREADS": str(len(spec.cores)),
                "PYTHONUNBUFFERED": "1",
                **self._env,
            }
            # The worker inherits its port bound (`LISTEN_FD_ENV`); this copy closes at once.
            with _listen(spec) as listener, open(spec.log_path, "ab") as log:
                self._processes[spec.name] = subprocess.Popen(
                    spec.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, LISTEN_FD_ENV: str(listener.fileno())},
                    pass_fds=(listener.fileno(),),
                    start_new_session=True,
                    preexec_fn=_child_setup(spec.cores, self._death_signal),
                )

    def pid(self, name: str) -> int:
        return self._processes[name].pid

    def is_running(self, name: str) -> bool:
        """Started and not exited."""
        process = self._processes.get(name)
        return process is not None and process.poll() is None

    def wait(self, name: str) -> int:
        """Block until the worker exits; its exit code."""
        return self._processes[name].wait()

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Return once every worker answers ``GET /health`` with 200. Raises
        `WorkerStartupError` when one exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.specs)
        verify = self._tls if self._tls is not None else True
        with httpx.Client(trust_env=False, timeout=poll_s * 4, verify=verify) as client:
            while pending:
                for spec in list(pending):
                    code = self._processes[spec.name].poll()
                    if code is not None:
                        raise WorkerStartupError(
                            f"{spec.name} exited with code {code} during startup; last lines "
                            f"of {spec.log_path}:\n{log_tail(spec.log_path)}"
                        )
                    if _is_healthy(client, spec.url):
                        pending.remove(spec)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    raise WorkerStartupError(
                        f"{names} not healthy after {timeout_s:.0f}s; last lines of "
                        f"{pending[0].log_path}:\n{log_tail(pending[0].log_path)}"
                    )
                if pending:
                    time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every live worker, then SIGKILL those still alive after `grace_s`."""
        live = [p for p in self._processes.values() if p.poll() is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _listen(spec: WorkerSpec) -> socket.socket:
    """A socket listening on the worker's address, as uvicorn would open it."""
    listener = socket.socket(socket.AF_INET6 if ":" in spec.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((spec.host, spec.port))
    except OSError as error:
        listener.close()
        taken = error.errno == errno.EADDRINUSE
        raise (PortTakenError if taken else WorkerStartupError)(
            f"{spec.name}: cannot bind {spec.host}:{spec.port}: {error}"
        ) from None
    listener.listen(2048)  # uvicorn's backlog
    return listener


def _child_setup(cores: tuple[int, ...], death_signal: signal.Signals):
    def setup() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
        _LIBC.prctl(_PR_SET_PDEATHSIG, death_signal)

    return setup


def _is_healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def log_tail(path: Path, num_lines: int = _LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read the log: {exc})"
    return "\n".join(lines[-num_lines:])
