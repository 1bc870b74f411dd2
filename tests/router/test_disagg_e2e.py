"""Disaggregated serving end to end on real workers (issue 4's CI tests).

One module-wide set of processes, all started at once so their model loads overlap:

- ``ref``: a colocated server (one thread): the greedy answers everything is compared with.
- ``shm`` / ``tcp``: `pdserve serve --mode disagg` (router + 1 prefill + 1 decode worker,
  pinned) over each transport, local prefill below 64 uncached tokens; lost KV is recomputed
  on ``shm`` and fails the request on ``tcp`` (``--kv-failure-policy fail``).
- ``b8``: a decode worker with another block size (a mismatched layout); with ``tcp``'s
  decode worker it also serves the decode-kill test, behind an in-process router.
- two hosts (when root with iproute2): a prefill and a decode worker in two network
  namespaces joined by a veth pair, a router beside the decode worker.

Tests that kill a worker run last on the deployment they break. After each fault, every
surviving worker is checked to hold no KV blocks (its /metrics free-blocks gauge).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from pdserve.bench.processes import metric_values
from pdserve.kv_transfer.shm import remove_stale_segments
from pdserve.kv_transfer.wire import HEADER, MAGIC, MessageType, encode_frame, read_frame
from pdserve.ports import free_port
from pdserve.router.config import RouterConfig
from tests.router.harness import ManagedProcess, RouterThread, http, iter_sse, read_sse, wait_until
from tests.router.netns import TwoHosts, netns_unavailable_reason, two_hosts
from tests.router.real_workers import (
    CHAT,
    COMPLETIONS,
    MAX_TOKENS,
    Disagg,
    Reference,
    Server,
    answer_text,
    assert_no_blocks_held,
    greedy,
    netns_router,
    netns_worker,
    stream_greedy,
    text_of,
)

pytestmark = pytest.mark.slow

THRESHOLD = 64
BLOCK_SIZE = 16
NETNS_UNAVAILABLE = netns_unavailable_reason()

LONG = text_of(400, 1)


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str
    body: dict
    route: str  # through a 1+1 deployment with THRESHOLD, run in CASES order
    stream: bool = False


CASES = [
    Case(
        "short_chat",
        CHAT,
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        "local",
    ),
    Case("long", COMPLETIONS, {"prompt": LONG}, "remote", stream=True),
    # Same prefix, a few new tokens: the decode worker has the rest cached -> local.
    Case("long_short_suffix", COMPLETIONS, {"prompt": LONG + " and then"}, "local"),
    # Same prefix, a long new part: remote; both workers have the prefix cached.
    Case("long_long_suffix", COMPLETIONS, {"prompt": LONG + " " + text_of(120, 5)}, "remote"),
]


@dataclass
class Cluster:
    ref: Reference
    shm: Disagg
    tcp: Disagg
    b8: Server
    hosts: TwoHostsDeployment | None


@dataclass
class TwoHostsDeployment:
    hosts: TwoHosts
    processes: list[ManagedProcess]
    prefill_url: str
    decode_url: str
    router_url: str = "http://127.0.0.1:8000"

    def wait_healthy(self) -> None:
        """Polled from inside host B (the prefill worker's address is reachable there)."""

        def runner(url: str) -> bool:
            return self.hosts.is_http_ok(self.hosts.ns_b, url)

        for process, url in zip(
            self.processes, (self.prefill_url, self.decode_url, self.router_url), strict=True
        ):
            process.wait_healthy(f"{url}/health", 900, runner=runner)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("disagg-e2e")
    with contextlib.ExitStack() as stack:
        hosts = None if NETNS_UNAVAILABLE is not None else stack.enter_context(two_hosts())
        processes: list[ManagedProcess] = []
        stack.callback(_stop_all, processes)  # before the namespaces go

        def started(server: Server) -> Server:
            processes.append(server.process)
            return server

        routing = ("--local-prefill-threshold", str(THRESHOLD), "--decode-policy", "prefix_aware")
        ref = started(Server(logs, "ref", "--mode", "colocated", "--num-threads", "1"))
        shm = started(Disagg(logs, "shm", "--kv-transport", "shm", *routing))
        tcp = started(
            Disagg(logs, "tcp", "--kv-transport", "tcp", *routing, "--kv-failure-policy", "fail")
        )
        b8 = started(
            Server(
                logs,
                "b8",
                "--role",
                "decode",
                "--kv-transport",
                "tcp",
                "--num-threads",
                "1",
                "--block-size",
                "8",
            )
        )
        deployment = None
        if hosts is not None:
            deployment = _start_two_hosts(hosts, logs)
            processes.extend(deployment.processes)
        for server in (ref, shm, tcp, b8):
            server.wait_healthy()
        if deployment is not None:
            deployment.wait_healthy()
        yield Cluster(Reference(ref), shm, tcp, b8, deployment)
    remove_stale_segments()  # those of workers the tests killed


def _stop_all(processes: list[ManagedProcess]) -> None:
    """SIGTERM everyone at once, then wait for each (they shut down in parallel)."""
    for process in processes:
        if process.process.poll() is None:
            process.process.terminate()
    for process in processes:
        process.stop(timeout=60)


def _start_two_hosts(hosts: TwoHosts, logs) -> TwoHostsDeployment:
    prefill_url, decode_url = f"http://{hosts.addr_a}:8100", f"http://{hosts.addr_b}:8100"
    return TwoHostsDeployment(
        hosts,
        [
            netns_worker(
                hosts, hosts.ns_a, "prefill", hosts.addr_a, 8100, logs / "netns-prefill.log"
            ),
            netns_worker(
                hosts, hosts.ns_b, "decode", hosts.addr_b, 8100, logs / "netns-decode.log"
            ),
            netns_router(hosts, prefill_url, decode_url, 8000, logs / "netns-router.log"),
        ],
        prefill_url,
        decode_url,
    )


# ---- greedy equality ------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_greedy_disagg_equals_colocated(transport, cluster):
    disagg: Disagg = getattr(cluster, transport)
    reports = {}
    with http() as client:
        for case in CASES:
            expected = cluster.ref.answer(case.endpoint, greedy(case.body))
            if case.stream:
                text, report = stream_greedy(client, f"{disagg.url}{case.endpoint}", case.body)
            else:
                response = client.post(
                    f"{disagg.url}{case.endpoint}", json=greedy(case.body), timeout=600
                )
                assert response.status_code == 200, response.text
                text = answer_text(response.json())
                report = {
                    **json.loads(response.headers["x-pdserve-timing"]),
                    "usage": response.json()["usage"],
                }
            assert (case.name, report["route"], text) == (case.name, case.route, expected)
            reports[case.name] = report
    _check_transfers(reports)
    prefill_url = disagg.worker_url("prefill-0")
    assert metric_values(prefill_url)["pdserve:prefix_cache_hit_rate"] > 0  # LONG reused
    assert_no_blocks_held(disagg.healthy_worker_urls())


def _check_transfers(reports: dict[str, dict]) -> None:
    """Remote requests fetched exactly the blocks their decode worker did not have cached;
    the timing breakdown is filled in."""
    long, suffix = reports["long"], reports["long_long_suffix"]
    assert long["usage"].get("prompt_tokens_details") is None  # nothing cached: all fetched
    bytes_per_block = long["kv_transfer_bytes"] / math.ceil(
        long["usage"]["prompt_tokens"] / BLOCK_SIZE
    )
    assert bytes_per_block == int(bytes_per_block) > 0
    cached = suffix["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (
        cached
        == reports["long_short_suffix"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= 25 * BLOCK_SIZE
    )  # LONG's blocks, on the decode side
    num_fetched = math.ceil(suffix["usage"]["prompt_tokens"] / BLOCK_SIZE) - cached // BLOCK_SIZE
    assert suffix["kv_transfer_bytes"] == num_fetched * bytes_per_block
    for report in (long, suffix):
        # A real forward step (not the two tokens leaving the engine together).
        assert report["kv_transfer_ms"] > 0 and report["first_decode_step_ms"] > 1.0
        assert report["prefill_ms"] > 0 and "router_queue_ms" in report
    for name in ("short_chat", "long_short_suffix"):
        assert reports[name]["kv_transfer_bytes"] == 0 and reports[name]["prefill_ms"] == 0


# ---- a transfer that never arrives, mismatched workers, garbage on the KV port -------------


def _prefill_leg(url: str, prompt: str) -> dict:
    """A prefill leg sent straight to a prefill worker: its KV params (blocks now leased)."""
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    response = httpx.post(f"{url}{COMPLETIONS}", json=body, trust_env=False, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def _decode_leg(url: str, prompt: str, params: dict, **extra) -> httpx.Response:
    body = greedy({"prompt": prompt}, kv_transfer_params=params, router_timing={}, **extra)
    return httpx.post(f"{url}{COMPLETIONS}", json=body, trust_env=False, timeout=600)


def _dead_port() -> int:
    return free_port()  # nothing listens there once the probe socket is closed


def test_transfer_that_never_arrives_recompute_completes_fail_errors(cluster):
    prompt = text_of(300, 2)
    expected = cluster.ref.answer(COMPLETIONS, greedy({"prompt": prompt}))
    shm_prefill, shm_decode, tcp_prefill, tcp_decode = (
        disagg.worker_url(worker)
        for disagg in (cluster.shm, cluster.tcp)
        for worker in ("prefill-0", "decode-0")
    )
    params = {"shm": _prefill_leg(shm_prefill, prompt), "tcp": _prefill_leg(tcp_prefill, prompt)}
    # The KV server named in the params is gone: nothing ever arrives.
    lost = {name: {**p, "remote_port": _dead_port()} for name, p in params.items()}

    recomputed = _decode_leg(shm_decode, prompt, lost["shm"])  # --kv-failure-policy recompute
    assert recomputed.status_code == 200, recomputed.text
    assert answer_text(recomputed.json()) == expected
    timing = recomputed.json()["pdserve_timing"]
    assert timing["kv_transfer_bytes"] == 0 and "kv_transfer_error" in timing
    assert timing["worker_prefill_ms"] > 0  # the prompt was computed here

    failed = _decode_leg(tcp_decode, prompt, lost["tcp"])  # --kv-failure-policy fail
    assert failed.status_code == 500 and "KV transfer failed" in failed.json()["error"]["message"]
    with httpx.stream(
        "POST",
        f"{tcp_decode}{COMPLETIONS}",
        trust_env=False,
        timeout=600,
        json=greedy({"prompt": prompt}, kv_transfer_params=lost["tcp"], stream=True),
    ) as response:
        events = read_sse(response)
    assert events[-1] == "[DONE]" and "KV transfer failed" in events[-2]["error"]["message"]

    # The real hand-offs still work (and release the prefill workers' leases).
    for decode_url, name in ((shm_decode, "shm"), (tcp_decode, "tcp")):
        delivered = _decode_leg(decode_url, prompt, params[name])
        assert answer_text(delivered.json()) == expected
        assert delivered.json()["pdserve_timing"]["kv_transfer_bytes"] > 0
    assert_no_blocks_held([shm_prefill, shm_decode, tcp_prefill, tcp_decode])


def test_mismatched_workers_are_refused_with_a_clear_error(cluster):
    prompt = text_of(100, 4)
    prefill_url, decode_url = (cluster.tcp.worker_url(w) for w in ("prefill-0", "decode-0"))
    params = _prefill_leg(prefill_url, prompt)

    other_layout = _decode_leg(cluster.b8.url, prompt, params)
    assert other_layout.status_code == 400
    error = other_layout.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert "layout" in error["message"] and "block_size 8" in error["message"]

    other_version = _decode_leg(decode_url, prompt, {**params, "protocol_version": 2})
    assert other_version.status_code == 400
    assert "protocol version 2" in other_version.json()["error"]["message"]

    # Refused by a decode worker's transport instead (tcp params, shm worker): it recomputes
    # the prompt, and still releases the prefill worker's lease.
    shm_decode = cluster.shm.worker_url("decode-0")
    other_transport = _decode_leg(shm_decode, prompt, params)
    assert other_transport.status_code == 200
    assert answer_text(other_transport.json()) == cluster.ref.answer(
        COMPLETIONS, greedy({"prompt": prompt})
    )
    assert "transport" in other_transport.json()["pdserve_timing"]["kv_transfer_error"]
    assert_no_blocks_held([prefill_url, decode_url, shm_decode, cluster.b8.url])


def test_a_refused_decode_leg_frees_the_prefill_workers_lease_at_once(cluster):
    """Through a router whose only decode worker has another layout: the client gets the
    refusal, and the router releases the lease instead of leaving it to --kv-lease-timeout
    (30 s here)."""
    prefill_url = cluster.tcp.worker_url("prefill-0")
    config = RouterConfig(
        prefill_urls=(prefill_url,), decode_urls=(cluster.b8.url,), health_interval_s=0.5
    )
    with RouterThread(config) as router:
        wait_until(lambda: all(w["state"] == "healthy" for w in router.workers().values()), 30)
        response = httpx.post(
            f"{router.url}{COMPLETIONS}",
            trust_env=False,
            timeout=600,
            json=greedy({"prompt": text_of(200, 5)}),
        )
        assert response.status_code == 400 and "layout" in response.json()["error"]["message"]
        assert_no_blocks_held([prefill_url, cluster.b8.url], timeout_s=10)


def test_garbage_frames_on_the_kv_port_are_refused_and_the_worker_serves_on(cluster):
    prefill_url = cluster.tcp.worker_url("prefill-0")
    prompt = text_of(200, 6)
    params = _prefill_leg(prefill_url, prompt)
    address = (params["remote_host"], params["remote_port"])
    hello = encode_frame(MessageType.HELLO, {})
    garbage = {
        "bad magic": os.urandom(64),
        "future version": encode_frame(MessageType.HELLO, {}, version=99),
        "oversized metadata": HEADER.pack(MAGIC, 1, MessageType.FETCH, 1 << 30, 0),
        "payload on a request": HEADER.pack(MAGIC, 1, MessageType.FETCH, 2, 1 << 40) + b"{}",
        "metadata not JSON": HEADER.pack(MAGIC, 1, MessageType.FETCH, 4, 0) + b"\xff{[(",
        "a reply sent as a request": encode_frame(MessageType.DATA, {}, payload_len=0),
    }
    for what, frame in garbage.items():
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(frame)
            refusal = read_frame(sock, max_payload=0)
            assert refusal.msg_type is MessageType.ERROR, what
            assert sock.recv(1) == b"", what  # and the connection is closed
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(hello[:7])  # a truncated header, then gone
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(hello)
        assert read_frame(sock, max_payload=0).msg_type is MessageType.REPLY  # still serving

    # The lease survived it all: the real hand-off completes, through the router too.
    decode_url = cluster.tcp.worker_url("decode-0")
    delivered = _decode_leg(decode_url, prompt, params)
    assert answer_text(delivered.json()) == cluster.ref.answer(
        COMPLETIONS, greedy({"prompt": prompt})
    )
    routed = httpx.post(
        f"{cluster.tcp.url}{COMPLETIONS}",
        json=greedy({"prompt": prompt + "!"}),
        trust_env=False,
        timeout=600,
    )
    assert routed.status_code == 200, routed.text
    assert cluster.tcp.workers()["prefill-0"]["state"] == "healthy"
    assert_no_blocks_held([prefill_url, decode_url])


# ---- clients and workers that go away ---------------------------------------------------------


def test_client_leaving_mid_prefill_leaves_no_blocks(cluster):
    disagg = cluster.shm
    prefill_url = disagg.worker_url("prefill-0")
    aborted_before = _num_aborted(prefill_url)
    # 2,500 tokens: more than one step's budget (2,048), so the prompt, alone on the worker,
    # is prefilled in two steps and the abort lands between them.
    body = json.dumps(greedy({"prompt": text_of(2500, 3)}, stream=True)).encode()
    host, port = disagg.url.removeprefix("http://").split(":")
    # A raw connection, closed as soon as the prompt is on the prefill worker (not after a
    # fixed time, which a fast CPU would need to finish the whole prefill in).
    with socket.create_connection((host, int(port))) as client:
        head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
        client.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: disagg.workers()["prefill-0"]["num_inflight"] > 0, 60)
    wait_until(lambda: all(w["num_inflight"] == 0 for w in disagg.workers().values()), 60)
    wait_until(
        lambda: _num_aborted(prefill_url) == aborted_before + 1,
        60,
        "the prefill worker to abort the leg",
    )
    assert_no_blocks_held(disagg.healthy_worker_urls())


def _num_aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve:request_success_total") and 'finished_reason="abort"' in line
    )


def test_decode_worker_killed_its_stream_errors_the_other_completes(cluster):
    # Two decode workers behind an in-process router, no prefill pool: all prefill locally.
    victim = cluster.tcp.worker_url("decode-0")
    config = RouterConfig(
        prefill_urls=(),
        decode_urls=(victim, cluster.b8.url),
        decode_policy="round_robin",
        health_interval_s=0.5,
    )
    results: dict[str, list] = {name: [] for name in ("a", "b")}
    streaming = {name: threading.Event() for name in results}

    with RouterThread(config) as router:
        wait_until(lambda: all(w["state"] == "healthy" for w in router.workers().values()), 30)

        def stream(name: str) -> None:
            body = {
                "prompt": f"Story {name}:",
                "max_tokens": 200,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            with (
                http() as client,
                client.stream(
                    "POST", f"{router.url}{COMPLETIONS}", json=body, timeout=600
                ) as response,
            ):
                for event in iter_sse(response):
                    results[name].append(event)
                    streaming[name].set()

        threads = {n: threading.Thread(target=stream, args=(n,)) for n in results}
        for name in ("a", "b"):  # round robin: a on the victim, b on b8
            threads[name].start()
            assert streaming[name].wait(120)
        os.kill(cluster.tcp.worker_pid("decode-0"), signal.SIGKILL)
        for thread in threads.values():
            thread.join(timeout=600)
        wait_until(lambda: router.workers()["decode-0"]["state"] == "unhealthy", 30)
    broken, complete = results["a"], results["b"]
    assert broken[-1] == "[DONE]" and "error" in broken[-2]
    assert complete[-1] == "[DONE]"
    assert sum(len(e["choices"]) for e in complete if isinstance(e, dict)) == 200
    assert_no_blocks_held([cluster.b8.url])


def test_prefill_worker_killed_under_load_requests_still_complete(cluster):
    from tests.router.test_autoscale_live import keep_sending

    disagg = cluster.shm

    # Distinct uncached prompts, so the prefill worker is busy computing when it dies; sent
    # until it is dead and out of rotation (a fast CPU would finish a fixed burst first).
    def request(i: int) -> tuple[str, int]:
        return text_of(500, 11 + i) + f" variant {i}", MAX_TOKENS

    with keep_sending(disagg.url, request, concurrency=3) as load:
        wait_until(lambda: disagg.workers()["prefill-0"]["num_inflight"] > 0, 60)
        os.kill(disagg.worker_pid("prefill-0"), signal.SIGKILL)
        wait_until(lambda: disagg.workers()["prefill-0"]["state"] == "unhealthy", 30)
    # Every request sent was answered in full (none failed), each as a colocated server does.
    for i, (text, _) in load.answers.items():
        body = {"prompt": load.prompts[i], "max_tokens": MAX_TOKENS, "ignore_eos": True}
        assert text == cluster.ref.answer(COMPLETIONS, greedy(body)), i
    assert_no_blocks_held(disagg.healthy_worker_urls())


# ---- two hosts ----------------------------------------------------------------------------------


@pytest.mark.skipif(NETNS_UNAVAILABLE is not None, reason=str(NETNS_UNAVAILABLE))
def test_kv_cache_crosses_a_veth_between_two_hosts(cluster):
    deployment = cluster.hosts
    hosts = deployment.hosts
    body = greedy({"prompt": LONG})
    rx_before = hosts.rx_bytes_b()
    result = hosts.post_json(hosts.ns_b, f"{deployment.router_url}{COMPLETIONS}", body)
    rx_delta = hosts.rx_bytes_b() - rx_before
    assert result["status"] == 200
    assert answer_text(result["body"]) == cluster.ref.answer(COMPLETIONS, body)
    assert result["timing"]["route"] == "remote"
    assert 0 < result["timing"]["kv_transfer_bytes"] <= rx_delta
