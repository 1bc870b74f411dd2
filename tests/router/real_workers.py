"""Real `pdserve serve` processes for the end-to-end disaggregation tests.

Every process is started without waiting (`start()`), so a module can launch all it needs at
once and the model loads overlap; `wait_healthy()` then waits for each.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.processes import num_held_blocks, worker_pid
from pdserve.ports import free_port
from tests.router.harness import ManagedProcess, http, read_sse, stream_text, wait_until
from tests.router.netns import TwoHosts

# float32 so that comparisons are about the hand-off, not bf16 kernel batch invariance.
ENGINE_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "8")
STARTUP_TIMEOUT_S = 900.0


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Greedy answers this long: compared token for token with the colocated reference's.
MAX_TOKENS = 12
WORDS = (
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"),
    *("wizards", "quietly", "judge", "boxing", "matches", "near", "an", "old", "river", "bank"),
)


def text_of(num_words: int, seed: int) -> str:
    """A prompt of `num_words` words; another `seed` shares no prefix with it."""
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(num_words))


def greedy(body: dict, **extra) -> dict:
    return {**body, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def stream_greedy(client: httpx.Client, url: str, body: dict) -> tuple[str, dict]:
    """A greedy stream's text, and its timing: the router's header plus the decode worker's
    `pdserve_timing` from the final usage chunk (relayed because the client asked)."""
    request = greedy(body, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", url, json=request, timeout=600) as response:
        assert response.status_code == 200, response.read()
        header = json.loads(response.headers["x-pdserve-timing"])
        events = read_sse(response)
    usage_chunk = events[-2]
    assert events[-1] == "[DONE]" and usage_chunk["choices"] == []
    return stream_text(events), {
        **usage_chunk["pdserve_timing"],
        "route": header["route"],
        "usage": usage_chunk["usage"],
    }


def serve_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "serve", *flags, *ENGINE_FLAGS]


def netns_worker(
    hosts: TwoHosts, ns: str, role: str, addr: str, port: int, log: Path, *flags: str
) -> ManagedProcess:
    """A `--role` worker inside namespace `ns`: its HTTP API and KV server (tcp) bind, and
    advertise, the namespace's veth address `addr`."""
    own = ("--role", role, "--host", addr, "--port", str(port), "--kv-transport", "tcp")
    argv = serve_argv(*own, "--kv-host", addr, "--num-threads", "1", *flags)
    return ManagedProcess(hosts.command(ns, argv), log)


def netns_router(
    hosts: TwoHosts, prefill_url: str, decode_url: str, port: int, log: Path, *flags: str
) -> ManagedProcess:
    """`pdserve router` in host B, in front of one prefill and one decode worker."""
    argv = [sys.executable, "-m", "pdserve.cli", "router", "--prefill", prefill_url]
    argv += ["--decode", decode_url, "--port", str(port), *flags]
    return ManagedProcess(hosts.command(hosts.ns_b, argv), log)


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


def stream_tokens(url: str, prompt: str, bounds: tuple[int, int], min_s: float = 0.0) -> int:
    """Tokens a stream of `prompt` needs to last 20 times a request without them (starting
    several streams, each until its first token, then what the test does to them, fit many
    times), and at least `min_s`, at this machine's pace at `url`, within `bounds` (the
    context)."""
    overhead_s, token_s = request_times(url, prompt)
    low, high = bounds
    return min(high, max(low, math.ceil(max(20 * overhead_s, min_s) / token_s)))


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
