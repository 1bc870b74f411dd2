"""Real `pdserve serve` processes for the end-to-end disaggregation tests.

Every process is started without waiting (`start()`), so a module can launch all it needs at
once and the model loads overlap; `wait_healthy()` then waits for each.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.processes import num_held_blocks, worker_pid
from tests.router.harness import ManagedProcess, free_port, http, wait_until

# float32 so that comparisons are about the hand-off, not bf16 kernel batch invariance.
ENGINE_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "8")
STARTUP_TIMEOUT_S = 900.0


def serve_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "serve", *flags, *ENGINE_FLAGS]


class Server:
    """One `pdserve serve` process (a worker, a colocated server or a disagg launcher)."""

    def __init__(
        self,
        log_dir: Path,
        name: str,
        *flags: str,
        wrap: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port if port is not None else free_port()
        self.url = f"http://{host}:{self.port}"
        argv = serve_argv("--host", host, "--port", str(self.port), *flags)
        self.process = ManagedProcess([*(wrap or []), *argv], log_dir / f"{name}.log")

    @property
    def pid(self) -> int:
        return self.process.process.pid

    def wait_healthy(self, runner=None) -> None:
        self.process.wait_healthy(f"{self.url}/health", STARTUP_TIMEOUT_S, runner=runner)


class Routed(Server):
    """A launcher of pinned workers behind a router (`flags` give the deployment)."""

    def __init__(self, log_dir: Path, name: str, *flags: str) -> None:
        super().__init__(
            log_dir,
            name,
            "--worker-log-dir",
            str(log_dir / f"{name}-workers"),
            "--health-check-interval",
            "0.5",
            *flags,
        )

    def workers(self) -> dict[str, dict[str, Any]]:
        listing = httpx.get(f"{self.url}/workers", trust_env=False).json()["workers"]
        return {w["id"]: w for w in listing}

    def worker_url(self, worker_id: str) -> str:
        return self.workers()[worker_id]["url"]

    def worker_pid(self, worker_id: str) -> int:
        """The launcher's child serving `worker_id` (matched by its --port)."""
        pid = worker_pid(self.pid, self.worker_url(worker_id))
        if pid is None:
            raise LookupError(f"no child process serves {worker_id}")
        return pid

    def healthy_worker_urls(self) -> list[str]:
        return [w["url"] for w in self.workers().values() if w["state"] == "healthy"]


class Disagg(Routed):
    """`pdserve serve --mode disagg` (router + 1 prefill + 1 decode worker, pinned)."""

    def __init__(self, log_dir: Path, name: str, *flags: str) -> None:
        super().__init__(log_dir, name, "--mode", "disagg", *flags)


class Reference:
    """Greedy answers from a colocated server (one thread, like a worker), cached."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._answers: dict[str, str] = {}
        self._lock = threading.Lock()

    def answer(self, endpoint: str, body: dict[str, Any]) -> str:
        key = f"{endpoint} {sorted(body.items())}"
        with self._lock:
            if key not in self._answers:
                with http() as client:
                    response = client.post(f"{self.server.url}{endpoint}", json=body, timeout=600)
                assert response.status_code == 200, response.text
                self._answers[key] = answer_text(response.json())
            return self._answers[key]


def request_times(url: str, prompt: str, num_tokens: int = 64) -> tuple[float, float]:
    """This machine's pace at `url`, one greedy request at a time (medians of three, after a
    warm-up): a request's time besides its generated tokens (HTTP, routing, tokenizing, the
    prefill), and each generated token's. What tests size their load or streams from, so
    that they hold on a CPU many times faster or slower than this one."""

    def timed(max_tokens: int) -> float:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        started = time.perf_counter()
        with http() as client:
            response = client.post(f"{url}/v1/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        return time.perf_counter() - started

    timed(8)
    overhead_s = statistics.median(timed(1) for _ in range(3))
    sample_s = statistics.median(timed(num_tokens + 1) for _ in range(3))
    return overhead_s, max((sample_s - overhead_s) / num_tokens, 1e-6)


def answer_text(response_json: dict[str, Any]) -> str:
    choice = response_json["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def assert_no_blocks_held(
    urls: list[str], timeout_s: float = 60.0, auth: httpx.Auth | None = None
) -> None:
    """Every worker's pool returns to all-free (leases are freed on their engine's next step,
    or when --kv-lease-timeout passes)."""
    for url in urls:
        wait_until(
            lambda u=url: num_held_blocks(u, auth) == 0,
            timeout_s,
            f"{url} to hold no KV blocks (holds {num_held_blocks(url, auth)})",
        )
