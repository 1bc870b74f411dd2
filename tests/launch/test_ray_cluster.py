"""`pdserve serve --mode disagg --cluster ray` on a real multi-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`): one node for the prefill pool and three for decode, told apart
by custom resources, each with one CPU, a small object store and no dashboard. The workers
start in one placement group (`--placement-strategy spread`), so a lost worker's bundle is
re-placed by Ray and its replacement starts there.

The deployment (1 prefill + 2 decode workers, real model, float32) serves greedy answers equal
to a colocated server's with the pools on different Ray nodes and the KV over tcp; refuses
clients without its fleet secret on worker HTTP and on the KV port; and, when a decode worker's
node is removed mid-stream, ends that worker's streams with an error, completes the others,
restores the pool on the spare node and leaks no KV blocks on the survivors.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray.cluster_utils import Cluster

from pdserve.api.signing import FleetAuth
from pdserve.bench.processes import num_held_blocks
from pdserve.kv_transfer import KVAuthError, KVTransferParams
from pdserve.kv_transfer.client import KVClient, release_lease
from pdserve.kv_transfer.wire import MessageType, encode_frame, read_frame
from pdserve.ports import free_port
from tests.router.harness import ManagedProcess, iter_sse, stream_text, wait_until
from tests.router.real_workers import (
    STARTUP_TIMEOUT_S,
    Reference,
    Server,
    answer_text,
    serve_argv,
    stream_tokens,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SECRET = "ray-test-fleet-secret"
AUTH = FleetAuth(SECRET)  # signs as the deployment's router does
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 32
# Streams the victim's node is removed under: sized from this machine's pace to last at least
# LONG_STREAM_S, so that they are still streaming when the node's processes die however fast
# the CPU, within these bounds (the context); the others are checked by their first
# MAX_TOKENS tokens (greedy: the longer answer begins with the shorter one).
LONG_STREAM_TOKENS = (256, 2000)
LONG_STREAM_S = 10.0
# A small footprint per Ray node: the machine has 2 vCPUs for everything.
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 78 * 2**20}
PREFILL_RESOURCES = {"CPU": 1, "pdserve_prefill": 1}
DECODE_RESOURCES = {"CPU": 1, "pdserve_decode": 1}


def prompt(index: int) -> str:
    return f"Story {index}: " + " ".join(f"word{(i * 7 + index) % 23}" for i in range(60))


def greedy(index: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt(index),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


@dataclass
class RayDeployment:
    cluster: Cluster
    nodes: dict[str, Any]  # Ray node id -> its cluster_utils node
    prefill_node: str
    launcher: ManagedProcess
    url: str
    expected: dict[int, str]  # prompt index -> the colocated server's greedy answer

    def workers(self) -> dict[str, dict[str, Any]]:
        listing = httpx.get(f"{self.url}/workers", trust_env=False, timeout=30).json()
        return {w["id"]: w for w in listing["workers"]}

    def healthy(self, role: str) -> list[dict[str, Any]]:
        return [w for w in self.workers().values() if w["role"] == role and w["state"] == "healthy"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[RayDeployment]:
    logs = tmp_path_factory.mktemp("ray-cluster")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")  # CI has no internet to report to
        yield from _deploy(logs)


def _deploy(logs: Path) -> Iterator[RayDeployment]:
    # The reference loads while the cluster starts, answers, and stops before the deployment.
    reference = Server(logs, "ref", "--mode", "colocated", "--num-threads", "1")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "num_cpus": 0, "include_dashboard": False},
    )
    launcher = None
    try:
        prefill = cluster.add_node(**NODE_ARGS, resources={"pdserve_prefill": 1})
        decodes = [cluster.add_node(**NODE_ARGS, resources={"pdserve_decode": 1}) for _ in "abc"]
        reference.wait_healthy()
        answers = Reference(reference)
        expected = {i: answers.answer(COMPLETIONS, greedy(i)) for i in range(5)}
        reference.process.stop()
        port = free_port()
        launcher = ManagedProcess(
            serve_argv(
                *("--mode", "disagg", "--cluster", "ray", "--port", str(port)),
                *("--prefill-workers", "1", "--decode-workers", "2"),
                *("--prefill-worker-resources", json.dumps(PREFILL_RESOURCES)),
                *("--decode-worker-resources", json.dumps(DECODE_RESOURCES)),
                *("--placement-strategy", "spread"),
                *("--decode-policy", "round_robin", "--health-check-interval", "0.5"),
                *("--worker-log-dir", str(logs / "workers")),
            ),
            logs / "launcher.log",
            env={"RAY_ADDRESS": cluster.address, "PDSERVE_FLEET_SECRET": SECRET},
        )
        url = f"http://127.0.0.1:{port}"
        launcher.wait_healthy(f"{url}/health", STARTUP_TIMEOUT_S)
        nodes = {node.node_id: node for node in (prefill, *decodes)}
        yield RayDeployment(cluster, nodes, prefill.node_id, launcher, url, expected)
    finally:
        reference.process.stop()
        if launcher is not None:
            launcher.stop(timeout=90)
        cluster.shutdown()
    assert launcher.process.returncode == 0, launcher.log_tail()  # stopped cleanly


def test_pools_on_different_nodes_kv_over_tcp_answers_equal_colocated(deployment):
    workers = deployment.workers()
    assert sorted(workers) == ["decode-0", "decode-1", "prefill-0"]
    assert workers["prefill-0"]["node_id"] == deployment.prefill_node
    decode_nodes = {workers[name]["node_id"] for name in ("decode-0", "decode-1")}
    assert len(decode_nodes) == 2 and deployment.prefill_node not in decode_nodes
    assert decode_nodes <= set(deployment.nodes)

    response = httpx.post(
        f"{deployment.url}{COMPLETIONS}", json=greedy(0), trust_env=False, timeout=600
    )
    assert response.status_code == 200, response.text
    assert answer_text(response.json()) == deployment.expected[0]
    timing = json.loads(response.headers["x-pdserve-timing"])
    assert timing["route"] == "remote" and timing["kv_transfer_bytes"] > 0
    # Across nodes the KV came over tcp: the decode worker mapped no one's shared segment.
    decode_url = workers[timing["decode_worker"]]["url"]
    assert foreign_kv_segments(decode_url) == set()


def test_a_client_without_the_secret_is_refused_by_worker_http_and_the_kv_port(deployment):
    workers = deployment.workers()
    prefill_url, decode_url = workers["prefill-0"]["url"], workers["decode-0"]["url"]
    for headers in ({}, {"Authorization": f"Bearer {SECRET}"}):
        with httpx.Client(trust_env=False, timeout=30, headers=headers) as stranger:
            for url in (prefill_url, decode_url):
                refused = [
                    stranger.post(f"{url}{COMPLETIONS}", json=greedy(1)),
                    stranger.post(f"{url}/tokenize", json={"prompt": "hi"}),
                    stranger.get(f"{url}/metrics"),
                    stranger.get(f"{url}/v1/models"),
                ]
                assert [r.status_code for r in refused] == [401] * 4
                assert all(SECRET not in r.text and "word" not in r.text for r in refused)
                health = stranger.get(f"{url}/health")
                assert health.status_code == 200 and health.json() == {"status": "ok"}

    # A member's prefill leg leases the KV of a user's prompt ...
    leg = {**greedy(1), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(
        f"{prefill_url}{COMPLETIONS}", json=leg, auth=AUTH, trust_env=False, timeout=600
    )
    assert answer.status_code == 200, answer.text
    params = KVTransferParams.from_dict(answer.json()["kv_transfer_params"])
    address = (params.remote_host, params.remote_port)
    # ... which a client without the secret can neither read nor free, nor learn about.
    with pytest.raises(KVAuthError):
        KVClient(*address, timeout=10).hello()
    with pytest.raises(KVAuthError):
        release_lease(params, timeout=10)
    fetch = {
        "request_id": params.remote_request_id,
        "layer_start": 0,
        "layer_end": 1,
        "block_ids": list(params.remote_block_ids),
    }
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(encode_frame(MessageType.FETCH, fetch))
        refusal = read_frame(sock, max_payload=0)
        assert (refusal.msg_type, refusal.meta["code"]) == (MessageType.ERROR, "unauthorized")
        assert sock.recv(1) == b""
    assert held_blocks(prefill_url) > 0  # the lease is intact
    assert release_lease(params, timeout=10, secret=SECRET) is True
    wait_until(lambda: held_blocks(prefill_url) == 0, 30, "the lease to be freed")


def test_decode_node_removed_mid_stream_others_complete_and_the_pool_is_restored(deployment):
    before = deployment.workers()
    num_tokens = stream_tokens(deployment.url, prompt(0), LONG_STREAM_TOKENS, LONG_STREAM_S)
    streams: dict[int, list[Any]] = {i: [] for i in range(4)}
    served_by: dict[int, str] = {}
    flowing = {i: threading.Event() for i in streams}

    def stream(index: int) -> None:
        with (
            httpx.Client(trust_env=False, timeout=600) as client,
            client.stream(
                "POST",
                f"{deployment.url}{COMPLETIONS}",
                json=greedy(index, stream=True, max_tokens=num_tokens),
            ) as response,
        ):
            served_by[index] = json.loads(response.headers["x-pdserve-timing"])["decode_worker"]
            for event in iter_sse(response):
                streams[index].append(event)
                if len(streams[index]) >= 3:
                    flowing[index].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in streams]
    for thread in threads:
        thread.start()
    for event in flowing.values():
        assert event.wait(600)
    victim = served_by[0]
    dead_node = before[victim]["node_id"]
    deployment.cluster.remove_node(deployment.nodes.pop(dead_node))
    for thread in threads:
        thread.join(timeout=600)

    for index, events in streams.items():
        assert events[-1] == "[DONE]", index
        if served_by[index] == victim:
            assert "error" in events[-2], events[-3:]  # a clear error, never a hang
        else:
            assert stream_text(events).startswith(deployment.expected[index])
            chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
            assert len(chunks) == num_tokens, index
    assert victim in served_by.values() and set(served_by.values()) != {victim}

    # The pool is back to two healthy decode workers, the new one on the spare node.
    wait_until(lambda: len(deployment.healthy("decode")) == 2, 600, "the decode pool restored")
    after = deployment.workers()
    assert victim not in after
    decode_nodes = {w["node_id"] for w in deployment.healthy("decode")}
    assert dead_node not in decode_nodes and decode_nodes <= set(deployment.nodes)
    survivors = [w["url"] for w in after.values() if w["state"] == "healthy"]
    wait_until(lambda: all(held_blocks(u) == 0 for u in survivors), 60, "no blocks held")

    # And it serves on: the next requests reach both decode workers, answers unchanged.
    for index in (3, 4):
        response = httpx.post(
            f"{deployment.url}{COMPLETIONS}", json=greedy(index), trust_env=False, timeout=600
        )
        assert response.status_code == 200, response.text
        assert answer_text(response.json()) == deployment.expected[index]


# ---- what a worker holds --------------------------------------------------------------------


def held_blocks(url: str) -> int:
    """KV blocks a worker holds for requests or leases (read with the fleet's secret)."""
    return num_held_blocks(url, AUTH)


def foreign_kv_segments(url: str) -> set[str]:
    """Shared-memory KV segments of other processes that the worker at `url` has mapped."""
    pid = _pid_listening_on(int(url.rsplit(":", 1)[1]))
    maps = Path(f"/proc/{pid}/maps").read_text()
    mapped = set(re.findall(r"/dev/shm/(pdserve-kv-(\d+)-[0-9a-f]+)", maps))
    return {name for name, owner in mapped if int(owner) != pid}


def _pid_listening_on(port: int) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if (
                b"serve" in argv
                and b"--port" in argv
                and argv[argv.index(b"--port") + 1] == (str(port).encode())
            ):
                return int(entry.name)
    raise LookupError(f"no pdserve worker process listens on port {port}")


# ---- autoscaling on the cluster ---------------------------------------------------------------


def test_the_autoscaler_grows_the_decode_pool_onto_another_ray_node(tmp_path):
    """`--autoscale` with the Ray placement: a burst of long generations queues on the one
    decode worker (two sequences at a time), the planner asks the Ray provisioner for a
    second, Ray places it on the other decode node, and the router routes to both."""
    from tests.router.test_autoscale_live import (
        MAX_NUM_SEQS,
        keep_sending,
        measure_decode_load,
        served_by,
        text_of,
    )
    from tests.server.conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny-model")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "num_cpus": 0, "include_dashboard": False},
    )
    launcher = None
    try:
        nodes = [cluster.add_node(**NODE_ARGS, resources={"pdserve_decode": 1}) for _ in "ab"]
        port = free_port()
        launcher = ManagedProcess(
            serve_argv(
                *("--mode", "disagg", "--cluster", "ray", "--port", str(port)),
                *("--model", str(model), "--max-model-len", "1024"),
                *("--prefill-workers", "0", "--decode-workers", "1"),
                *("--decode-worker-resources", json.dumps(DECODE_RESOURCES)),
                *("--autoscale", "--autoscale-interval", "0.5", "--autoscale-grace", "2"),
                *("--max-prefill-workers", "0", "--max-decode-workers", "2"),
                *("--slo", "ttft:60000,itl:100000"),
                *("--worker-args", f"--max-num-seqs {MAX_NUM_SEQS}"),
                *("--health-check-interval", "0.5", "--worker-log-dir", str(tmp_path / "w")),
            ),
            tmp_path / "launcher.log",
            env={"RAY_ADDRESS": cluster.address, "RAY_USAGE_STATS_ENABLED": "0"},
        )
        url = f"http://127.0.0.1:{port}"
        launcher.wait_healthy(f"{url}/health", STARTUP_TIMEOUT_S)

        def decode_workers() -> list[dict[str, Any]]:
            listing = httpx.get(f"{url}/workers", trust_env=False, timeout=30).json()["workers"]
            return [w for w in listing if w["role"] == "decode" and w["state"] == "healthy"]

        # Load until the planner acts (a fast CPU would finish a fixed burst first), sized
        # from this deployment's own request times (its one decode worker cannot be drained).
        load_size = measure_decode_load(url)
        with keep_sending(
            url,
            lambda i: (text_of(20, i), load_size.max_tokens),
            concurrency=load_size.concurrency,
        ) as load:
            wait_until(
                lambda: len(decode_workers()) == 2,
                600,
                f"a second decode worker ({load_size.measured})",
            )
            # While the load lasts (once it ends the pool is soon drained), both answer.
            wait_until(lambda: len(served_by(load)) == 2, 600, "answers from both")
            placed = {w["node_id"] for w in decode_workers()}
        state = httpx.get(f"{url}/autoscale", trust_env=False, timeout=30).json()
        first_decision = state["decisions"][0]
        assert (first_decision["action"], first_decision["role"]) == ("add", "decode")
        assert placed == {node.node_id for node in nodes}  # one on each decode node
    finally:
        if launcher is not None:
            launcher.stop(timeout=90)
        cluster.shutdown()
    assert launcher.process.returncode == 0, launcher.log_tail()


# ---- fleet TLS on the cluster ----------------------------------------------------------------


def test_with_fleet_tls_the_pools_answer_and_workers_admit_only_member_certificates(tmp_path):
    """`--fleet-tls` with the Ray placement: the launcher's CA issues each worker its
    certificate, which reaches it through its actor; the pools on two nodes answer through
    the router (KV over tcp, in TLS), every worker URL is https, nothing of the credentials
    is in a worker's argv, and a client without a member's certificate gets no session."""
    from tests.server.conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny-model")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "num_cpus": 0, "include_dashboard": False},
    )
    launcher = None
    try:
        cluster.add_node(**NODE_ARGS, resources={"pdserve_prefill": 1})
        cluster.add_node(**NODE_ARGS, resources={"pdserve_decode": 1})
        port = free_port()
        launcher = ManagedProcess(
            serve_argv(
                *("--mode", "disagg", "--cluster", "ray", "--port", str(port), "--fleet-tls"),
                *("--model", str(model), "--max-model-len", "1024"),
                *("--prefill-worker-resources", json.dumps(PREFILL_RESOURCES)),
                *("--decode-worker-resources", json.dumps(DECODE_RESOURCES)),
                *("--health-check-interval", "0.5", "--worker-log-dir", str(tmp_path / "w")),
            ),
            tmp_path / "launcher.log",
            env={"RAY_ADDRESS": cluster.address, "RAY_USAGE_STATS_ENABLED": "0"},
        )
        url = f"http://127.0.0.1:{port}"
        launcher.wait_healthy(f"{url}/health", STARTUP_TIMEOUT_S)
        wait_until(
            lambda: len(httpx.get(f"{url}/workers", trust_env=False).json()["workers"]) == 2,
            600,
            "both workers registered",
        )
        response = httpx.post(
            f"{url}{COMPLETIONS}", json=greedy(2, max_tokens=8), trust_env=False, timeout=600
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        timing = json.loads(response.headers["x-pdserve-timing"])
        assert timing["route"] == "remote" and timing["kv_transfer_bytes"] > 0
        workers = httpx.get(f"{url}/workers", trust_env=False, timeout=30).json()["workers"]
        for worker in workers:
            assert worker["url"].startswith("https://") and worker["state"] == "healthy"
            worker_port = int(worker["url"].rsplit(":", 1)[1])
            argv = Path(f"/proc/{_pid_listening_on(worker_port)}/cmdline").read_bytes()
            assert b"PRIVATE KEY" not in argv and b"CERTIFICATE" not in argv
            plain = worker["url"].replace("https://", "http://")
            for target, verify in ((worker["url"], False), (plain, True)):
                with pytest.raises(httpx.HTTPError):  # no certificate, or no TLS at all
                    httpx.get(f"{target}/health", verify=verify, trust_env=False, timeout=30)
    finally:
        if launcher is not None:
            launcher.stop(timeout=90)
        cluster.shutdown()
    assert launcher.process.returncode == 0, launcher.log_tail()
