"""Disaggregated serving end to end on real workers (issue 4's CI tests).

Skipped until the worker side exists: `pdserve serve --role` (worker tests) and
`pdserve serve --mode disagg` (launcher tests); they turn on by themselves once it does.

- Greedy output through the router equals colocated output, over shm and tcp, for short
  prompts (local prefill) and long ones (remote), with prefix-cache hits on both sides.
- kill -9 a prefill worker under load: requests still complete (retry / local prefill).
- kill a decode worker: its stream ends with an error event, the other completes.
- A client leaving mid-prefill; after each: no KV blocks held on surviving workers.
- Two hosts for real: prefill and decode in two network namespaces joined by a veth pair.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

from pdserve.router.load_scrape import parse_worker_load
from tests.router.harness import (
    ManagedProcess,
    free_port,
    http,
    read_sse,
    stream_text,
    wait_until,
)
from tests.router.netns import netns_unavailable_reason, two_hosts


def _serve_options() -> dict[str, argparse.Action]:
    from pdserve.server.cli import add_parser

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_parser(subparsers)
    return {flag: a for a in subparsers.choices["serve"]._actions for flag in a.option_strings}


SERVE_OPTIONS = _serve_options()
HAS_ROLES = "--role" in SERVE_OPTIONS
HAS_DISAGG_MODE = "disagg" in (SERVE_OPTIONS["--mode"].choices or ())

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAS_ROLES, reason="pdserve serve --role not supported yet")]
requires_launcher = pytest.mark.skipif(
    not HAS_DISAGG_MODE, reason="pdserve serve --mode disagg not wired yet")

# float32 so that the comparison is about the hand-off, not bf16 kernel batch invariance.
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "8"]
THRESHOLD = 64
MAX_TOKENS = 12
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge", "boxing", "matches", "near", "an", "old", "river",
         "bank")


def text_of(num_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(num_words))


LONG = text_of(400, 1)
# (name, endpoint, body, route through a 1+1 disagg with THRESHOLD), run in this order.
CASES = [
    ("short_chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "What is the capital of France?"}]}, "local"),
    ("long", "/v1/completions", {"prompt": LONG}, "remote"),
    # Same prefix, a few new tokens: the decode worker has the rest cached -> local.
    ("long_short_suffix", "/v1/completions", {"prompt": LONG + " and then"}, "local"),
    # Same prefix, a long new part: remote, prefill-side cache hit on the prefix.
    ("long_long_suffix", "/v1/completions", {"prompt": LONG + " " + text_of(120, 5)}, "remote"),
]


def request_body(body: dict, **extra) -> dict:
    return {**body, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def answer_text(response_json: dict) -> str:
    choice = response_json["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def serve(tmp_path: Path, name: str, args: list[str], port: int) -> ManagedProcess:
    process = ManagedProcess([sys.executable, "-m", "pdserve.cli", "serve", *args, "--port",
                              str(port), *ENGINE_FLAGS], tmp_path / f"{name}.log")
    try:
        process.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=900)
    except BaseException:
        process.stop()
        raise
    return process


@pytest.fixture(scope="module")
def colocated_reference(tmp_path_factory) -> dict[str, str]:
    """Greedy outputs of every case from a colocated server (one thread, like a worker)."""
    port = free_port()
    server = serve(tmp_path_factory.mktemp("colocated"), "colocated",
                   ["--mode", "colocated", "--num-threads", "1"], port)
    try:
        with http() as client:
            return {name: answer_text(client.post(f"http://127.0.0.1:{port}{endpoint}",
                                                  json=request_body(body)).json())
                    for name, endpoint, body, _ in CASES}
    finally:
        server.stop()


class Disagg:
    """`pdserve serve --mode disagg` in a subprocess; the router's URL and its workers."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = serve(tmp_path, "disagg", [
            "--mode", "disagg", "--worker-log-dir", str(tmp_path / "workers"),
            "--health-check-interval", "0.5", *flags], self.port)

    def workers(self) -> dict[str, dict]:
        listing = httpx.get(f"{self.url}/workers", trust_env=False).json()["workers"]
        return {w["id"]: w for w in listing}

    def worker_pid(self, worker_id: str) -> int:
        """The launcher's child serving `worker_id` (matched by its --port)."""
        port = self.workers()[worker_id]["url"].rsplit(":", 1)[1]
        for pid in _children(self.process.process.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--port" in argv and argv[argv.index(b"--port") + 1].decode() == port:
                return pid
        raise LookupError(f"no child process serves {worker_id}")

    def assert_no_blocks_held(self) -> None:
        """Every live worker's KV usage returns to 0 (cached-but-free blocks do not count)."""
        def usage(url: str) -> float | None:
            text = httpx.get(f"{url}/metrics", trust_env=False).text
            return parse_worker_load(text).kv_cache_usage

        for worker in self.workers().values():
            if worker["state"] == "healthy":
                wait_until(lambda u=worker["url"]: usage(u) == 0.0, 30,
                           f"{worker['id']} holds no KV blocks")

    def stop(self) -> None:
        self.process.stop(timeout=60)
        assert self.process.process.returncode == 0, self.process.log_tail()


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


@requires_launcher
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_greedy_disagg_equals_colocated(transport, colocated_reference, tmp_path):
    disagg = Disagg(tmp_path, "--kv-transport", transport, "--local-prefill-threshold",
                    str(THRESHOLD), "--decode-policy", "prefix_aware")
    try:
        with http() as client:
            for name, endpoint, body, route in CASES:
                response = client.post(f"{disagg.url}{endpoint}", json=request_body(body))
                assert response.status_code == 200, response.text
                timing = json.loads(response.headers["x-pdserve-timing"])
                assert (name, timing["route"]) == (name, route)
                assert answer_text(response.json()) == colocated_reference[name], name
                if route == "remote":
                    assert timing["kv_transfer_bytes"] > 0
            name, endpoint, body, _ = CASES[1]
            with client.stream("POST", f"{disagg.url}{endpoint}",
                               json=request_body(body, stream=True)) as response:
                assert stream_text(read_sse(response)) == colocated_reference[name]
        disagg.assert_no_blocks_held()
    finally:
        disagg.stop()


@requires_launcher
def test_prefill_worker_killed_under_load_requests_still_complete(colocated_reference,
                                                                  tmp_path):
    disagg = Disagg(tmp_path)  # threshold 0: every prompt goes through the prefill worker
    name, endpoint, body, _ = CASES[1]
    answers: list[str] = []

    def send() -> None:
        with http() as client:
            response = client.post(f"{disagg.url}{endpoint}", json=request_body(body))
            answers.append(answer_text(response.json()) if response.status_code == 200
                           else response.text)

    try:
        threads = [threading.Thread(target=send) for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_until(lambda: disagg.workers()["prefill-0"]["num_inflight"] > 0, 60)
        os.kill(disagg.worker_pid("prefill-0"), signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=600)
        assert answers == [colocated_reference[name]] * 3
        wait_until(lambda: disagg.workers()["prefill-0"]["state"] == "unhealthy", 30)
        disagg.assert_no_blocks_held()
    finally:
        disagg.stop()


@requires_launcher
def test_decode_worker_killed_its_stream_errors_the_other_completes(tmp_path):
    disagg = Disagg(tmp_path, "--decode-workers", "2", "--decode-policy", "round_robin",
                    "--local-prefill-threshold", "100000")
    results: dict[str, list] = {}

    def stream(name: str) -> None:
        body = {"prompt": f"Story {name}:", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with http() as client, client.stream("POST", f"{disagg.url}/v1/completions",
                                             json=body) as response:
            results[name] = read_sse(response)

    try:
        threads = {n: threading.Thread(target=stream, args=(n,)) for n in ("a", "b")}
        for name in ("a", "b"):  # round robin: a on decode-0, b on decode-1
            threads[name].start()
            wait_until(lambda n=name: disagg.workers()[f"decode-{'ab'.index(n)}"][
                "num_inflight"] == 1, 60)
        os.kill(disagg.worker_pid("decode-0"), signal.SIGKILL)
        for thread in threads.values():
            thread.join(timeout=600)
        broken, complete = results["a"], results["b"]
        assert broken[-1] == "[DONE]" and "error" in broken[-2]
        assert complete[-1] == "[DONE]"
        assert sum(len(e["choices"]) for e in complete if isinstance(e, dict)) == 200
        disagg.assert_no_blocks_held()
    finally:
        disagg.stop()


@requires_launcher
def test_client_leaving_mid_prefill_leaves_no_blocks(tmp_path):
    disagg = Disagg(tmp_path)
    try:
        long_body = request_body({"prompt": text_of(1500, 3)}, stream=True)
        with pytest.raises(httpx.ReadTimeout), httpx.Client(trust_env=False,
                                                            timeout=0.5) as client:
            client.post(f"{disagg.url}/v1/completions", json=long_body)
        wait_until(lambda: all(w["num_inflight"] == 0 for w in disagg.workers().values()), 60)
        disagg.assert_no_blocks_held()
    finally:
        disagg.stop()


NETNS_UNAVAILABLE = netns_unavailable_reason()


@pytest.mark.skipif(NETNS_UNAVAILABLE is not None, reason=str(NETNS_UNAVAILABLE))
def test_kv_cache_crosses_a_veth_between_two_hosts(colocated_reference, tmp_path):
    name, endpoint, body, _ = CASES[1]
    with two_hosts() as hosts:
        def worker(ns: str, role: str, addr: str) -> ManagedProcess:
            argv = [sys.executable, "-m", "pdserve.cli", "serve", "--role", role, "--host",
                    addr, "--port", "8100", "--kv-transport", "tcp", "--num-threads", "1",
                    *ENGINE_FLAGS]
            return ManagedProcess(hosts.command(ns, argv), tmp_path / f"{role}.log")

        def healthy_in_b(url: str) -> bool:
            return hosts.is_http_ok(hosts.ns_b, url)

        prefill_url = f"http://{hosts.addr_a}:8100"
        decode_url = f"http://{hosts.addr_b}:8100"
        processes = [worker(hosts.ns_a, "prefill", hosts.addr_a),
                     worker(hosts.ns_b, "decode", hosts.addr_b)]
        processes.append(ManagedProcess(hosts.command(hosts.ns_b, [
            sys.executable, "-m", "pdserve.cli", "router", "--prefill", prefill_url,
            "--decode", decode_url, "--port", "8000"]), tmp_path / "router.log"))
        try:
            for process, url in zip(processes, (prefill_url, decode_url,
                                                "http://127.0.0.1:8000"), strict=True):
                process.wait_healthy(f"{url}/health", 900, runner=healthy_in_b)
            rx_before = hosts.rx_bytes_b()
            result = hosts.post_json(hosts.ns_b, f"http://127.0.0.1:8000{endpoint}",
                                     request_body(body))
            rx_delta = hosts.rx_bytes_b() - rx_before
        finally:
            for process in processes:
                process.stop()
    assert result["status"] == 200 and answer_text(result["body"]) == colocated_reference[name]
    assert result["timing"]["route"] == "remote"
    assert 0 < result["timing"]["kv_transfer_bytes"] <= rx_delta
