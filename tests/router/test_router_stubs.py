"""The router end to end against stub workers (tests/router/stub_worker.py): the hand-off,
the local-prefill threshold, retries and fallbacks, disconnects, the circuit breaker,
/workers and the timing breakdown."""

from __future__ import annotations

import json
import sys
import threading
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.core.block_manager import extend_block_hashes
from pdserve.ports import free_port
from pdserve.router.config import RouterConfig
from tests.router.harness import (
    ManagedProcess,
    RouterThread,
    http,
    read_sse,
    router_config,
    start_stubs,
    stream_text,
    wait_until,
)
from tests.router.netns import netns_unavailable_reason, two_hosts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stubs():
    # "*_doomed" stubs are killed by the test that uses them.
    workers = start_stubs(
        ("prefill", None),
        ("prefill", None),
        ("prefill", 500),
        ("decode", None),
        ("decode", None),
        ("prefill", None),
        ("decode", None),
    )
    names = ("p0", "p1", "pfail", "d0", "d1", "p_doomed", "d_doomed")
    yield dict(zip(names, workers, strict=True))
    for worker in workers:
        worker.stop()


def marker() -> str:
    return f"m{uuid.uuid4().hex[:10]}"


def completion(prompt: str, **extra) -> dict:
    return {"model": "stub", "prompt": prompt, "max_tokens": 3, **extra}


def test_streaming_hand_off_passes_both_legs_fields(stubs):
    p0, d0 = stubs["p0"], stubs["d0"]
    tag = marker()
    with RouterThread(router_config([p0], [d0])) as router, http() as client:
        body = completion(f"{tag} hello", stream=True, min_tokens=2)
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = read_sse(response)
    prefill_leg = p0.bodies(tag)[0]
    assert prefill_leg["max_tokens"] == 1 and prefill_leg["stream"] is False
    assert prefill_leg["kv_transfer_params"] == {"do_remote_decode": True}
    assert "min_tokens" not in prefill_leg and "router_timing" not in prefill_leg
    prefill_answer = next(
        e for e in p0.log() if e["event"] == "prefilled" and tag in e["body"]["prompt"]
    )
    decode_leg = d0.bodies(tag)[0]
    assert decode_leg["max_tokens"] == 3 and decode_leg["stream"] is True
    assert decode_leg["min_tokens"] == 2
    assert decode_leg["kv_transfer_params"]["remote_request_id"] == prefill_answer["request_id"]
    assert decode_leg["kv_transfer_params"]["remote_engine_id"] == f"stub-{p0.port}"
    assert decode_leg["router_timing"]["prefill_ms"] > 0
    assert decode_leg["router_timing"]["router_queue_ms"] >= 0
    # The router asked for usage to read the worker's timing, and hid it from this client.
    assert decode_leg["stream_options"] == {"include_usage": True}
    assert events[-1] == "[DONE]" and stream_text(events) == "t0 t1 t2 "
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_streaming_usage_chunk_carries_the_timing_breakdown(stubs):
    with RouterThread(router_config([stubs["p0"]], [stubs["d0"]])) as router, http() as client:
        body = {
            "model": "stub",
            "messages": [{"role": "user", "content": marker()}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as response:
            header = json.loads(response.headers["x-pdserve-timing"])
            events = read_sse(response)
    assert header["route"] == "remote" and header["prefill_worker"] == "prefill-0"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2
    timing = usage_chunk["pdserve_timing"]
    assert timing["prefill_ms"] == pytest.approx(header["prefill_ms"])
    assert timing["kv_transfer_bytes"] > 0 and "first_decode_step_ms" in timing


def test_non_streaming_answer_has_timing_header_and_metrics_move(stubs):
    with RouterThread(router_config([stubs["p0"]], [stubs["d0"]])) as router, http() as client:
        response = client.post(f"{router.url}/v1/completions", json=completion(marker()))
        metrics_text = client.get(f"{router.url}/metrics").text
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "t0 t1 t2 "
    timing = json.loads(response.headers["x-pdserve-timing"])
    assert timing["route"] == "remote" and timing["decode_worker"] == "decode-0"
    assert timing["kv_transfer_ms"] == 1.5 and timing["e2e_ms"] >= timing["prefill_ms"] > 0
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
    }
    assert samples[("pdserve:router_prefill_leg_seconds_count", ())] == 1
    assert samples[("pdserve:router_kv_transfer_bytes_count", ())] == 1
    assert samples[("pdserve:router_requests_total", (("route", "remote"),))] == 1
    up = (
        "pdserve:router_worker_up",
        (("role", "decode"), ("url", stubs["d0"].url), ("worker", "decode-0")),
    )
    assert samples[up] == 1


def test_local_prefill_threshold_skips_the_prefill_worker_for_short_uncached_prompts(stubs):
    p0, d0 = stubs["p0"], stubs["d0"]
    long_prompt = marker() + "x" * 100  # stub tokenizer: one token per character
    config = router_config([p0], [d0], local_prefill_threshold=50, decode_policy="prefix_aware")
    with RouterThread(config) as router, http() as client:

        def route(prompt: str) -> str:
            response = client.post(f"{router.url}/v1/completions", json=completion(prompt))
            assert response.status_code == 200
            return json.loads(response.headers["x-pdserve-timing"])["route"]

        short = marker()
        assert route(short) == "local"
        assert route(long_prompt) == "remote"
        # 110 tokens of which d0's events say it caches 96 (6 blocks of 16): 17 uncached.
        index = router.runtime.registry.decode.prefix_index
        hashes = extend_block_hashes([], [ord(c) for c in long_prompt], 16)
        wait_until(lambda: index.num_cached_tokens(d0.url, hashes, 110) == 96, 10.0)
        assert route(long_prompt + "y" * 3) == "local"
    assert p0.bodies(short) == [] and "kv_transfer_params" not in d0.bodies(short)[0]
    assert len(p0.bodies(long_prompt)) == 1  # only the first long prompt went remote


def test_failed_prefill_is_retried_on_another_worker(stubs):
    pfail, p1, d0 = stubs["pfail"], stubs["p1"], stubs["d0"]
    config = router_config([pfail, p1], [d0], prefill_policy="round_robin")
    tag = marker()
    with RouterThread(config) as router, http() as client:
        response = client.post(f"{router.url}/v1/completions", json=completion(tag))
    timing = json.loads(response.headers["x-pdserve-timing"])
    assert response.status_code == 200
    assert timing["route"] == "remote" and timing["num_prefill_attempts"] == 2
    assert timing["prefill_worker"] == "prefill-1"
    assert len(pfail.bodies(tag)) == 1 and len(p1.bodies(tag)) == 1
    assert d0.bodies(tag)[0]["kv_transfer_params"]["remote_engine_id"] == f"stub-{p1.port}"


def test_prefill_failing_twice_falls_back_to_local_prefill(stubs):
    pfail, d0 = stubs["pfail"], stubs["d0"]
    tag = marker()
    with RouterThread(router_config([pfail], [d0])) as router, http() as client:
        response = client.post(f"{router.url}/v1/completions", json=completion(tag))
    assert response.status_code == 200
    assert json.loads(response.headers["x-pdserve-timing"])["route"] == "local_fallback"
    assert "kv_transfer_params" not in d0.bodies(tag)[0]


def test_client_error_on_the_prefill_leg_is_relayed_not_retried(stubs):
    p0, p1, d0 = stubs["p0"], stubs["p1"], stubs["d0"]
    tag = marker()
    with RouterThread(router_config([p0, p1], [d0])) as router, http() as client:
        response = client.post(f"{router.url}/v1/completions", json=completion(tag, model="gpt-9"))
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    assert len(p0.bodies(tag)) + len(p1.bodies(tag)) == 1 and d0.bodies(tag) == []


def test_prefill_worker_killed_under_the_router_is_retried_then_left_out(stubs):
    doomed, alive, decode = stubs["p_doomed"], stubs["p1"], stubs["d0"]
    # Health checks too rare to notice the kill: the request itself must.
    config = router_config(
        [doomed, alive], [decode], prefill_policy="round_robin", health_interval_s=60.0
    )
    with RouterThread(config) as router, http() as client:
        doomed.kill()
        tag = marker()
        response = client.post(f"{router.url}/v1/completions", json=completion(tag))
        assert response.status_code == 200
        assert json.loads(response.headers["x-pdserve-timing"])["route"] == "remote"
        assert router.workers()["prefill-0"]["state"] == "unhealthy"
        assert len(alive.bodies(tag)) == 1


def test_decode_worker_death_ends_its_stream_with_an_error_others_complete(stubs):
    d0, d1 = stubs["d_doomed"], stubs["d1"]
    config = router_config([], [d0, d1], decode_policy="round_robin", health_interval_s=60.0)
    results: dict[str, list] = {}
    with RouterThread(config) as router:

        def stream(name: str) -> None:
            body = completion(f"{name} {marker()}", stream=True, stub_decode_hold=name)
            with (
                http() as client,
                client.stream("POST", f"{router.url}/v1/completions", json=body) as response,
            ):
                results[name] = read_sse(response)

        threads = {n: threading.Thread(target=stream, args=(n,)) for n in ("a", "b")}
        for name, stub in (("a", d0), ("b", d1)):  # round robin: a on d0, b on d1
            threads[name].start()
            wait_until(lambda s=stub, n=name: s.events_for(f"{n} m"), 10, f"stream {name}")
        d0.kill()
        d1.release("b")
        for thread in threads.values():
            thread.join(timeout=30)
        assert router.workers()["decode-0"]["state"] == "unhealthy"
    broken, complete = results["a"], results["b"]
    assert broken[-1] == "[DONE]" and "error" in broken[-2]
    assert broken[-2]["error"]["type"] == "upstream_error"
    assert stream_text(broken) == "t0 "
    assert complete[-1] == "[DONE]" and stream_text(complete) == "t0 t1 t2 "


def test_client_disconnect_mid_stream_closes_the_decode_leg(stubs):
    d0 = stubs["d0"]
    tag = marker()
    with RouterThread(router_config([stubs["p0"]], [d0])) as router:
        with (
            http() as client,
            client.stream(
                "POST",
                f"{router.url}/v1/completions",
                json=completion(tag, stream=True, stub_decode_hold=tag),
            ) as response,
        ):
            next(response.iter_lines())  # the first token arrived; now leave
        wait_until(lambda: "disconnected" in d0.events_for(tag), 10, "decode leg closed")
        wait_until(lambda: router.workers()["decode-0"]["num_inflight"] == 0, 10)
    assert "completed" not in d0.events_for(tag)


def test_client_disconnect_mid_prefill_closes_the_prefill_leg(stubs):
    p0, d0 = stubs["p0"], stubs["d0"]
    tag = marker()
    with RouterThread(router_config([p0], [d0])) as router:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(trust_env=False, timeout=1.0) as client:
            client.post(
                f"{router.url}/v1/completions",
                json=completion(tag, stream=True, stub_prefill_hold=tag),
            )
        wait_until(lambda: "disconnected" in p0.events_for(tag), 10, "prefill leg closed")
        wait_until(lambda: all(w["num_inflight"] == 0 for w in router.workers().values()), 10)
    assert d0.bodies(tag) == []  # no decode leg for a client that left


def test_circuit_breaker_takes_a_failing_worker_out_and_back(stubs):
    d0, d1 = stubs["d0"], stubs["d1"]
    config = router_config([], [d0, d1], decode_policy="round_robin", unhealthy_threshold=1)
    with RouterThread(config) as router, http() as client:
        try:
            d0.set_health(False)
            wait_until(lambda: router.workers()["decode-0"]["state"] == "unhealthy", 10)
            tag = marker()
            for _ in range(3):
                assert (
                    client.post(f"{router.url}/v1/completions", json=completion(tag)).status_code
                    == 200
                )
            assert d0.bodies(tag) == [] and len(d1.bodies(tag)) == 3
        finally:
            d0.set_health(True)
        wait_until(lambda: router.workers()["decode-0"]["state"] == "healthy", 10)
        tag = marker()
        for _ in range(2):
            client.post(f"{router.url}/v1/completions", json=completion(tag))
        assert len(d0.bodies(tag)) == 1 and len(d1.bodies(tag)) == 1


def test_no_healthy_decode_worker_is_a_503(stubs):
    nobody = RouterConfig(prefill_urls=(), decode_urls=(f"http://127.0.0.1:{free_port()}",))
    with RouterThread(nobody) as router, http() as client:
        response = client.post(f"{router.url}/v1/completions", json=completion("x"))
        assert (
            response.status_code == 503 and "decode worker" in response.json()["error"]["message"]
        )
        assert client.get(f"{router.url}/health").status_code == 503


def test_bad_bodies_get_openai_style_400s(stubs):
    with RouterThread(router_config([], [stubs["d0"]])) as router, http() as client:
        url = f"{router.url}/v1/completions"
        not_json = client.post(url, content=b"{nope", headers={"content-type": "application/json"})
        assert (
            not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
        )
        bad_stream = client.post(url, json={"prompt": "x", "stream": "yes"})
        assert bad_stream.status_code == 400 and bad_stream.json()["error"]["param"] == "stream"
        assert client.post(url, json=[1, 2]).status_code == 400


def test_workers_api_adds_drains_and_removes_behind_the_api_key(stubs):
    d0, d1 = stubs["d0"], stubs["d1"]
    auth = {"Authorization": "Bearer sekrit"}
    with RouterThread(router_config([], [d0], api_key="sekrit")) as router, http() as client:
        assert client.get(f"{router.url}/workers").status_code == 401
        assert client.post(f"{router.url}/v1/completions", json=completion("x")).status_code == 401
        assert client.get(f"{router.url}/health").status_code == 200  # open, like a worker

        added = client.post(
            f"{router.url}/workers", headers=auth, json={"url": d1.url, "role": "decode"}
        )
        assert added.status_code == 201 and added.json()["state"] == "healthy"
        assert (
            client.post(
                f"{router.url}/workers", headers=auth, json={"url": d1.url, "role": "decode"}
            ).status_code
            == 409
        )
        bad_role = client.post(
            f"{router.url}/workers", headers=auth, json={"url": d1.url, "role": "both"}
        )
        assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "role"

        # Drain decode-0 while it holds a stream: it takes nothing new, then disappears.
        tag = marker()
        holder = threading.Thread(target=lambda: _hold_stream(router.url, auth, tag))
        holder.start()
        wait_until(lambda: router.workers(auth)["decode-0"]["num_inflight"] == 1, 10)
        drained = client.delete(f"{router.url}/workers/decode-0", headers=auth)
        assert drained.status_code == 202 and drained.json()["draining"] is True
        other = marker()
        for _ in range(2):
            client.post(f"{router.url}/v1/completions", headers=auth, json=completion(other))
        assert d0.bodies(other) == [] and len(d1.bodies(other)) == 2
        d0.release(tag)
        holder.join(timeout=30)
        wait_until(lambda: "decode-0" not in router.workers(auth), 10, "drained worker removed")
        assert client.delete(f"{router.url}/workers/decode-0", headers=auth).status_code == 404
        gone = client.delete(f"{router.url}/workers/{added.json()['id']}", headers=auth)
        assert gone.status_code == 200 and gone.json()["removed"] is True


def _hold_stream(url: str, auth: dict[str, str], tag: str) -> None:
    body = completion(tag, stream=True, stub_decode_hold=tag)
    with (
        http() as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=auth) as response,
    ):
        assert stream_text(read_sse(response)) == "t0 t1 t2 "


def test_models_and_health_are_proxied_and_summarised(stubs):
    with RouterThread(router_config([stubs["p0"]], [stubs["d0"]])) as router, http() as client:
        assert client.get(f"{router.url}/v1/models").json()["data"][0]["id"] == "stub"
        health = client.get(f"{router.url}/health").json()
        assert health["decode"] == {"routable": 1, "total": 1}
        assert health["prefill"] == {"routable": 1, "total": 1}


NETNS_UNAVAILABLE = netns_unavailable_reason()


@pytest.mark.skipif(NETNS_UNAVAILABLE is not None, reason=str(NETNS_UNAVAILABLE))
def test_hand_off_across_two_network_namespaces(tmp_path):
    """The two-host plumbing of the real-worker test, with stubs: prefill on host A, decode
    and the router on host B, the client on B; every leg crosses the veth or B's loopback."""
    with two_hosts() as hosts:

        def on(ns: str, name: str, argv: list[str]) -> ManagedProcess:
            return ManagedProcess(
                hosts.command(ns, [sys.executable, *argv]), tmp_path / f"{name}.log"
            )

        def healthy_in_b(url: str) -> bool:
            return hosts.is_http_ok(hosts.ns_b, url)

        prefill_url, decode_url = f"http://{hosts.addr_a}:8100", f"http://{hosts.addr_b}:8200"
        processes = [
            on(
                hosts.ns_a,
                "prefill",
                [
                    "-m",
                    "tests.router.stub_worker",
                    "--role",
                    "prefill",
                    "--host",
                    hosts.addr_a,
                    "--port",
                    "8100",
                ],
            ),
            on(
                hosts.ns_b,
                "decode",
                [
                    "-m",
                    "tests.router.stub_worker",
                    "--role",
                    "decode",
                    "--host",
                    hosts.addr_b,
                    "--port",
                    "8200",
                ],
            ),
            on(
                hosts.ns_b,
                "router",
                [
                    "-m",
                    "pdserve.cli",
                    "router",
                    "--prefill",
                    prefill_url,
                    "--decode",
                    decode_url,
                    "--port",
                    "8000",
                    "--health-check-interval",
                    "0.5",
                ],
            ),
        ]
        try:
            for process, url in zip(
                processes, (prefill_url, decode_url, "http://127.0.0.1:8000"), strict=True
            ):
                process.wait_healthy(f"{url}/health", 60, runner=healthy_in_b)
            result = hosts.post_json(
                hosts.ns_b, "http://127.0.0.1:8000/v1/completions", completion("across hosts")
            )
        finally:
            for process in processes:
                process.stop()
    assert result["status"] == 200 and result["body"]["choices"][0]["text"] == "t0 t1 t2 "
    assert result["timing"]["route"] == "remote"


def test_decode_worker_refusal_is_relayed_with_its_status(stubs):
    with RouterThread(router_config([], [stubs["d0"]])) as router, http() as client:
        response = client.post(
            f"{router.url}/v1/completions",
            json=completion(marker(), model="gpt-9", stream=True),
        )
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    assert response.headers["x-request-id"].startswith("rtr-")
