"""The streamed KV hand-off (``--kv-handoff stream``) on real workers (issue 24).

One module-wide set of processes, started at once: ``ref``, a colocated server (the greedy
answers), and ``stream``, `pdserve serve --mode disagg --kv-handoff stream` over tcp whose
prefill worker computes 64 tokens a step (a long prompt is many chunks) and logs its steps.
With root and iproute2 a last test shapes a veth between two namespaces with `tc` and checks
that streaming beats pulling where the link is about as slow as the prefill.

Tests that kill a worker run last (a spare decode worker is the one killed). After each,
the survivors hold no KV blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.router.config import KVHandoff, RouterConfig
from tests.router.harness import (
    ManagedProcess,
    RouterThread,
    http,
    iter_sse,
    stream_text,
    wait_until,
)
from tests.router.netns import TwoHosts, netns_unavailable_reason, shape_link, two_hosts
from tests.router.real_workers import (
    CHAT,
    COMPLETIONS,
    Disagg,
    Reference,
    Server,
    answer_text,
    assert_no_blocks_held,
    greedy,
    metric_values,
    netns_router,
    netns_worker,
    stream_greedy,
    text_of,
)

pytestmark = pytest.mark.slow

CHUNK = 64


class Deployment:
    def __init__(self, logs: Path) -> None:
        self.step_log = logs / "steps.jsonl"
        self.ref = Server(logs, "ref", "--mode", "colocated", "--num-threads", "1")
        self.disagg = Disagg(
            logs,
            "stream",
            "--kv-transport",
            "tcp",
            "--kv-handoff",
            "stream",
            "--kv-lease-timeout",
            "300",
            "--prefill-worker-args",
            f"--max-num-batched-tokens {CHUNK}",
            "--step-log",
            str(self.step_log),
        )
        # A decode worker of its own, for the test that kills one (behind its own router).
        self.spare_decode = Server(
            logs, "spare-decode", "--role", "decode", "--kv-transport", "tcp", "--num-threads", "1"
        )

    @property
    def prefill_steps(self) -> int:
        path = self.step_log.with_name("steps.prefill-0.jsonl")
        return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    made = Deployment(tmp_path_factory.mktemp("kv-stream"))
    processes = [made.ref.process, made.disagg.process, made.spare_decode.process]
    try:
        for server in (made.ref, made.disagg, made.spare_decode):
            server.wait_healthy()
        wait_until(lambda: len(made.disagg.healthy_worker_urls()) == 2, 120, "both workers")
        yield made
    finally:
        for process in processes:
            process.stop(timeout=60)


def test_streamed_hand_off_equals_colocated_greedy(deployment):
    reference = Reference(deployment.ref)
    url = deployment.disagg.url
    cases = [
        (COMPLETIONS, {"prompt": text_of(300, 1)}),
        (CHAT, {"messages": [{"role": "user", "content": text_of(250, 2)}]}),
    ]
    with http() as client:
        for endpoint, body in cases:
            expected = reference.answer(endpoint, greedy(body))
            text, timing = stream_greedy(client, f"{url}{endpoint}", body)
            assert text == expected
            assert timing["kv_transfer_bytes"] > 0 and "kv_transfer_error" not in timing
            assert 0 <= timing["kv_transfer_exposed_ms"] <= timing["kv_transfer_ms"]
            assert timing["kv_transfer_hidden_ms"] >= 0
            response = client.post(f"{url}{endpoint}", json=greedy(body), timeout=600)
            assert answer_text(response.json()) == expected  # cached prefix now: same answer
    decode = metric_values(deployment.disagg.worker_url("decode-0"))
    assert decode["pdserve:kv_transfer_exposed_seconds_count"] >= 2
    assert_no_blocks_held(deployment.disagg.healthy_worker_urls())


def _long_stream(url: str, prompt: str, events: list) -> threading.Thread:
    def run() -> None:
        body = greedy({"prompt": prompt}, stream=True, stream_options={"include_usage": True})
        with (
            http() as client,
            client.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=600) as response,
        ):
            events.extend(iter_sse(response))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_decode_worker_killed_mid_stream_frees_the_prefill_blocks_at_once(deployment):
    """The deployment's prefill worker streams to the spare decode worker (an in-process
    router over the two), which is killed after a few chunks."""
    prefill_url = deployment.disagg.worker_url("prefill-0")
    config = RouterConfig(
        prefill_urls=(prefill_url,),
        decode_urls=(deployment.spare_decode.url,),
        kv_handoff=KVHandoff.STREAM,
        health_interval_s=0.5,
    )
    with RouterThread(config) as router:
        wait_until(lambda: all(w["state"] == "healthy" for w in router.workers().values()), 60)
        steps_before = deployment.prefill_steps
        events: list = []
        thread = _long_stream(router.url, text_of(1200, 4), events)
        wait_until(lambda: deployment.prefill_steps >= steps_before + 3, 300, "three chunks")
        os.kill(deployment.spare_decode.pid, signal.SIGKILL)
        thread.join(timeout=600)
    assert "error" in events[-2]
    # The lease would hold them 300 s: they are free once the prefill leg has ended.
    assert_no_blocks_held([prefill_url], timeout_s=60)


def test_prefill_worker_killed_after_some_chunks_the_decode_worker_keeps_them(deployment):
    disagg = deployment.disagg
    prompt = text_of(1200, 3)  # ~1200 tokens: ~19 chunks of 64
    expected = Reference(deployment.ref).answer(COMPLETIONS, greedy({"prompt": prompt}))
    decode_url = disagg.worker_url("decode-0")
    steps_before = deployment.prefill_steps
    events: list = []
    thread = _long_stream(disagg.url, prompt, events)
    # Five chunks computed (and published as their steps ended), then the worker dies.
    wait_until(lambda: deployment.prefill_steps >= steps_before + 5, 300, "five chunks")
    os.kill(disagg.worker_pid("prefill-0"), signal.SIGKILL)
    thread.join(timeout=600)
    assert events[-1] == "[DONE]"
    assert stream_text(events) == expected
    timing = events[-2]["pdserve_timing"]
    num_prompt = events[-2]["usage"]["prompt_tokens"]
    # Whole blocks of the chunks that arrived are kept; only the rest was computed here.
    assert 16 <= timing["kv_kept_tokens"] < num_prompt and "kv_transfer_error" in timing
    assert metric_values(decode_url)["pdserve:kv_stream_kept_tokens_total"] >= 16
    assert_no_blocks_held([decode_url])


# ---- a shaped link between two hosts ----------------------------------------------------------

NETNS_UNAVAILABLE = netns_unavailable_reason()
SHAPED_PROMPT_TOKENS = 1024
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M, bfloat16


@pytest.mark.skipif(NETNS_UNAVAILABLE is not None, reason=str(NETNS_UNAVAILABLE))
def test_on_a_slow_link_streaming_beats_pulling(tmp_path):
    with two_hosts() as hosts, _two_host_deployment(hosts, tmp_path) as ttft:
        # The link's rate set so that pulling the KV takes about as long as the prefill:
        # streaming hides most of it behind the prefill's later chunks.
        prefill_s = statistics.median(ttft("alone") for _ in range(2))
        rate = int(8 * SHAPED_PROMPT_TOKENS * KV_BYTES_PER_TOKEN / prefill_s)
        shape_link(hosts, f"{rate}bit")
        pulled = statistics.median(ttft("pull") for _ in range(3))
        streamed = statistics.median(ttft("stream") for _ in range(3))
    assert streamed < pulled, (prefill_s, streamed, pulled)


@contextlib.contextmanager
def _two_host_deployment(hosts: TwoHosts, logs: Path):
    """Prefill worker in A; decode worker and a pull and a stream router in B. Yields
    ttft(mode): a fresh prompt's time to first token, from inside B."""
    port = 8100
    prefill_url, decode_url = f"http://{hosts.addr_a}:{port}", f"http://{hosts.addr_b}:{port}"

    def worker(ns: str, role: str, addr: str) -> ManagedProcess:
        # 128-token chunks: the prompt's KV leaves in eight pieces.
        chunks = ("--max-num-batched-tokens", "128")
        return netns_worker(hosts, ns, role, addr, port, logs / f"{role}.log", *chunks)

    def router(handoff: str, router_port: int) -> ManagedProcess:
        log = logs / f"router-{handoff}.log"
        return netns_router(
            hosts, prefill_url, decode_url, router_port, log, "--kv-handoff", handoff
        )

    processes = [
        worker(hosts.ns_a, "prefill", hosts.addr_a),
        worker(hosts.ns_b, "decode", hosts.addr_b),
        router("pull", 8001),
        router("stream", 8002),
    ]
    urls = {
        "alone": f"{prefill_url}{COMPLETIONS}",
        "pull": f"http://127.0.0.1:8001{COMPLETIONS}",
        "stream": f"http://127.0.0.1:8002{COMPLETIONS}",
    }
    seeds = iter(range(1_000_000))

    def ttft(mode: str) -> float:
        seed = next(seeds)
        prompt = [1000 + (seed * 7919 + i * 104_729) % 39_000 for i in range(SHAPED_PROMPT_TOKENS)]
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
        code = (
            "import httpx, json, sys, time\nbody = json.loads(sys.argv[2])\n"
            "start = time.perf_counter()\n"
            "with httpx.stream('POST', sys.argv[1], json=body, trust_env=False,\n"
            "                  timeout=600) as r:\n"
            "  for line in r.iter_lines():\n"
            "    if line.startswith('data: {'):\n"
            "      print(time.perf_counter() - start); break\n"
        )
        argv = hosts.command(hosts.ns_b, [sys.executable, "-c", code, urls[mode], json.dumps(body)])
        out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
        return float(out.stdout)

    try:
        runner = lambda url: hosts.is_http_ok(hosts.ns_b, url)  # noqa: E731
        for process, url in zip(processes, (prefill_url, decode_url), strict=False):
            process.wait_healthy(f"{url}/health", 900, runner=runner)
        wait_until(lambda: all(_routes_to_both(hosts, p) for p in (8001, 8002)), 120, "the routers")
        ttft("alone"), ttft("pull"), ttft("stream")  # warm-up
        yield ttft
    finally:
        for process in processes:
            process.stop(timeout=60)


def _routes_to_both(hosts: TwoHosts, port: int) -> bool:
    code = (
        "import httpx, sys\nw = httpx.get(sys.argv[1], trust_env=False).json()['workers']\n"
        "sys.exit(len(w) < 2 or any(x['state'] != 'healthy' for x in w))"
    )
    argv = hosts.command(
        hosts.ns_b, [sys.executable, "-c", code, f"http://127.0.0.1:{port}/workers"]
    )
    return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
