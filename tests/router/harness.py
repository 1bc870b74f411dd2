"""Processes and servers for router tests: stub workers, a router on a thread, SSE reading."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from pdserve.ports import free_port
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, what: str = "", interval_s: float = 0.02
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what or predicate}")
        time.sleep(interval_s)


def http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=30.0)


class StubWorker:
    """A `tests.router.stub_worker` process on a free port."""

    def __init__(self, role: str, fail_status: int | None = None) -> None:
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "tests.router.stub_worker",
            "--role",
            role,
            "--port",
            str(self.port),
        ]
        if fail_status is not None:
            command += ["--fail-status", str(fail_status)]
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def wait_healthy(self, timeout: float = 30.0) -> StubWorker:
        def is_up() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"stub exited: {self.process.stderr.read().decode()}")
            try:
                return httpx.get(f"{self.url}/health", trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(is_up, timeout, f"stub {self.role} on {self.port}")
        return self

    def log(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/stub/log", trust_env=False).json()

    def events_for(self, marker: str) -> list[str]:
        """Events logged for requests whose prompt (or messages) contain `marker`."""
        return [e["event"] for e in self.log() if marker in json.dumps(e["body"])]

    def bodies(self, marker: str, event: str = "received") -> list[dict[str, Any]]:
        return [
            e["body"] for e in self.log() if e["event"] == event and marker in json.dumps(e["body"])
        ]

    def release(self, tag: str) -> None:
        httpx.post(f"{self.url}/stub/release/{tag}", trust_env=False)

    def set_health(self, ok: bool) -> None:
        httpx.post(f"{self.url}/stub/health", json={"ok": ok}, trust_env=False)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process.stderr.close()


def start_stubs(*specs: tuple[str, int | None]) -> list[StubWorker]:
    """Start all stubs at once (they import in parallel), then wait for each."""
    stubs = [StubWorker(role, fail) for role, fail in specs]
    for stub in stubs:
        stub.wait_healthy()
    return stubs


class AppThread:
    """An ASGI app under uvicorn on a thread of the test process, on a free port."""

    def __init__(self, app) -> None:
        self.app = app
        # proto IPPROTO_TCP, else asyncio skips TCP_NODELAY on accepted connections and every
        # response waits out a delayed ACK (~40 ms).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", access_log=False)
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self):
        self._thread.start()
        wait_until(lambda: self._server.started, 60.0, "app startup")
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


class RouterThread(AppThread):
    """The router app on a thread of the test process."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(build_app(config))
        self.runtime = self.app.state.runtime

    def workers(self, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
        listing = httpx.get(f"{self.url}/workers", headers=headers, trust_env=False).json()
        return {w["id"]: w for w in listing["workers"]}


def router_config(prefill: list[StubWorker], decode: list[StubWorker], **kwargs) -> RouterConfig:
    kwargs.setdefault("health_interval_s", 0.2)
    kwargs.setdefault("health_timeout_s", 2.0)
    return RouterConfig(
        prefill_urls=tuple(s.url for s in prefill),
        decode_urls=tuple(s.url for s in decode),
        **kwargs,
    )


def iter_sse(response: httpx.Response) -> Iterator[Any]:
    """The JSON payloads of a streamed response's events as they come, then "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def read_sse(response: httpx.Response) -> list[Any]:
    return list(iter_sse(response))


def stream_text(events: list[Any]) -> str:
    parts = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices", []):
                parts.append(choice.get("text") or choice.get("delta", {}).get("content", ""))
    return "".join(parts)


class ManagedProcess:
    """A server process (any argv) with its output in a log file; `wait_healthy` polls a URL."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
            )

    def wait_healthy(
        self,
        url: str,
        timeout: float = 600.0,
        runner: Callable[[str], bool] | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """Poll `url` until it answers 200 (through `runner` when given, e.g. in a netns;
        `verify`: a --fleet-tls member's client context for an https `url`)."""

        def is_up() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.argv[:6]} exited {self.process.returncode}:\n{self.log_tail()}"
                )
            if runner is not None:
                return runner(url)
            try:
                answer = httpx.get(url, trust_env=False, timeout=5, verify=verify)
                return answer.status_code == 200
            except httpx.HTTPError:
                return False

        # A runner may start a process per probe (e.g. in a netns): probe it less often.
        wait_until(is_up, timeout, f"{url} healthy", interval_s=0.02 if runner is None else 1.0)

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
