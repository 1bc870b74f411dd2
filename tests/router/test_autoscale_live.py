"""Autoscaling and role switching on real workers: `pdserve serve --mode disagg --autoscale`
on this host's cores, with the tiny random-weight model (one core per worker).

Each test starts its own deployment (its SLO makes one pool's signal fire); the workers'
greedy answers after a change are compared with the same deployment's answers before it, and
every worker left is checked to hold no KV blocks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.harness import http, wait_until
from tests.router.real_workers import Disagg, answer_text, assert_no_blocks_held
from tests.server.conftest import write_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one per worker"),
]

INTERVAL_S = 0.5
GRACE_S = 2.0
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "wizards")


def text_of(num_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(num_words))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@contextlib.contextmanager
def deployment(
    tmp_path: Path, model: Path, *flags: str, autoscale: bool = True
) -> Iterator[Disagg]:
    scaling = (
        ("--autoscale", "--autoscale-interval", str(INTERVAL_S), "--autoscale-grace", str(GRACE_S))
        if autoscale
        else ()
    )
    server = Disagg(
        tmp_path,
        "deployment",
        *("--model", str(model), "--max-model-len", "1024"),
        *scaling,
        *flags,
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.process.stop(timeout=90)


def complete(url: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """A greedy completion of exactly `max_tokens` tokens: its text and routing header."""
    with http() as client:
        response = client.post(
            f"{url}/v1/completions",
            json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            timeout=300,
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    return answer_text(response.json()), json.loads(response.headers.get("x-pdserve-timing", "{}"))


def burst(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[tuple]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens), prompts))


@contextlib.contextmanager
def keep_sending(
    url: str, request: Callable[[int], tuple[str, int]], concurrency: int
) -> Iterator[list[tuple]]:
    """Greedy completions (`request(i)`: prompt and max_tokens) sent back to back by
    `concurrency` clients while the block runs; yields their results as they complete."""
    results: list[tuple] = []
    stop = threading.Event()
    counter = itertools.count()

    def client() -> None:
        while not stop.is_set():
            results.append(complete(url, *request(next(counter))))

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        yield results
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    assert results


def autoscale_state(server: Disagg) -> dict:
    return httpx.get(f"{server.url}/autoscale", trust_env=False, timeout=30).json()


def decisions(server: Disagg) -> list[tuple[str, str, str]]:
    return [(d["action"], d["role"], d["reason"]) for d in autoscale_state(server)["decisions"]]


def pool_sizes(server: Disagg) -> dict[str, int]:
    sizes = {"prefill": 0, "decode": 0}
    for worker in server.workers().values():
        if worker["state"] == "healthy" and not worker["draining"]:
            sizes[worker["role"]] += 1
    return sizes


def wait_for(server: Disagg, what: str, predicate, timeout_s: float = 300.0) -> None:
    wait_until(
        predicate,
        timeout_s,
        f"{what} (decisions {decisions(server)}, pools {pool_sizes(server)})",
        interval_s=0.2,
    )


def assert_paced(server: Disagg) -> None:
    """At most one change per interval, none within the grace period after an addition."""
    made = autoscale_state(server)["decisions"]
    for earlier, later in itertools.pairwise(made):
        gap = later["time_s"] - earlier["time_s"]
        assert gap >= INTERVAL_S - 1e-6, made
        if earlier["action"] == "add":
            assert gap >= GRACE_S - 1e-6, made


def router_samples(server: Disagg) -> dict[tuple[str, tuple], float]:
    """The router's autoscaling samples by (name, sorted labels)."""
    text = httpx.get(f"{server.url}/metrics", trust_env=False, timeout=30).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "scaling" in sample.name or "pool_workers" in sample.name
    }


def test_a_burst_of_long_prompts_grows_the_prefill_pool_and_quiet_shrinks_it(tmp_path, tiny_model):
    # No prefill worker at first: the decode worker prefills, and any TTFT over 1 ms is over
    # the SLO. Room for one prefill worker beside it.
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "0", "--decode-workers", "1", "--max-prefill-workers", "1"),
        *("--max-decode-workers", "1", "--slo", "ttft:1,itl:100000"),
    ) as server:
        # Bursts until the planner acts: a fast CPU prefills a burst within one interval.
        with keep_sending(server.url, lambda i: (text_of(600, i), 2), concurrency=3) as sent:
            wait_for(server, "a prefill worker", lambda: pool_sizes(server)["prefill"] == 1)
        assert sent[0][1]["route"] == "local"
        assert decisions(server)[0] == ("add", "prefill", "ttft")
        # Long prompts now go through it...
        _, timing = complete(server.url, text_of(600, 99), 2)
        assert timing["route"] == "remote"
        # ...and once quiet it is drained and stopped: the pool is back to none.
        wait_for(server, "the prefill pool to shrink", lambda: pool_sizes(server)["prefill"] == 0)
        assert decisions(server)[-1] == ("remove", "prefill", "idle")
        wait_for(
            server,
            "the drained worker to leave",
            lambda: {w["role"] for w in server.workers().values()} == {"decode"},
        )
        samples = router_samples(server)
        assert samples[("pdserve:pool_workers", (("role", "prefill"),))] == 0
        assert samples[("pdserve:pool_workers", (("role", "decode"),))] == 1
        decided = "pdserve:scaling_decisions_total"
        for direction, reason in (("up", "ttft"), ("down", "idle")):
            labels = (("direction", direction), ("reason", reason), ("role", "prefill"))
            assert samples[(decided, labels)] == 1
        assert_paced(server)
        assert_no_blocks_held(server.healthy_worker_urls())


def test_a_drained_worker_loses_no_request(tmp_path, tiny_model):
    """The prefill worker is quiet (its TTFT far under the SLO) while requests keep coming:
    it is drained and stopped mid-traffic; every request completes."""
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "1", "--decode-workers", "1", "--max-prefill-workers", "1"),
        *("--max-decode-workers", "1", "--slo", "ttft:60000,itl:100000"),
    ) as server:
        prefill_pid = server.worker_pid("prefill-0")
        results, stop = [], threading.Event()

        def client() -> None:
            i = 0
            while not stop.is_set():
                results.append(complete(server.url, text_of(300, i), 24))
                i += 1

        worker = threading.Thread(target=client)
        worker.start()
        try:
            wait_for(
                server, "the prefill worker drained", lambda: pool_sizes(server)["prefill"] == 0
            )
            time.sleep(2)  # requests keep flowing, prefilled locally now
        finally:
            stop.set()
            worker.join(timeout=120)
        routes = [timing["route"] for _, timing in results]
        assert "remote" in routes and routes[-1] == "local", routes
        assert decisions(server) == [("remove", "prefill", "idle")]
        wait_until(lambda: not Path(f"/proc/{prefill_pid}").exists(), 60, "prefill-0 to exit")
        assert_no_blocks_held(server.healthy_worker_urls())


def test_a_burst_of_long_generations_grows_the_decode_pool(tmp_path, tiny_model):
    # Two sequences per decode worker: a burst of long generations queues, which is pressure.
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "0", "--decode-workers", "1", "--max-prefill-workers", "0"),
        *("--max-decode-workers", "2", "--slo", "ttft:60000,itl:100000"),
        *("--worker-args", "--max-num-seqs 2"),
    ) as server:
        prompts = [text_of(20, i) for i in range(10)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(burst, server.url, prompts, 400, 10)
            wait_for(server, "a second decode worker", lambda: pool_sizes(server)["decode"] == 2)
            assert all(text for text, _ in first.result())
        assert decisions(server)[0] == ("add", "decode", "queue")
        later = burst(server.url, prompts[:4], 16, 4)
        assert {timing["decode_worker"] for _, timing in later} == {"decode-0", "decode-1"}
        assert_paced(server)
        assert_no_blocks_held(server.healthy_worker_urls())


def test_the_planner_switches_an_idle_prefill_worker_to_a_saturated_decode_pool(
    tmp_path, tiny_model
):
    # Both cores are taken (1 + 1), so the decode pool can grow only by a switch.
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "1", "--decode-workers", "1", "--max-prefill-workers", "1"),
        *("--max-decode-workers", "2", "--slo", "ttft:60000,itl:100000"),
        *("--worker-args", "--max-num-seqs 2"),
    ) as server:
        checks = [text_of(200, i) for i in range(4)]
        reference = [text for text, _ in burst(server.url, checks, 48, 1)]
        # Short prompts, long generations: the decode worker is the bottleneck.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(burst, server.url, [text_of(20, i) for i in range(10)], 400, 10)
            wait_for(server, "a switch to decode", lambda: pool_sizes(server)["decode"] == 2)
            assert all(text for text, _ in first.result())
        assert decisions(server)[0] == ("switch", "decode", "queue")
        (outcome,) = autoscale_state(server)["outcomes"]
        assert outcome["previous_id"] == "prefill-0" and outcome["worker"]["id"] == "decode-1"
        # Through the router (prefilled locally now) and at the switched worker itself, the
        # answers are those of before.
        assert [text for text, _ in burst(server.url, checks, 48, 4)] == reference
        switched = server.worker_url("decode-1")
        assert [text for text, _ in burst(switched, checks, 48, 2)] == reference
        assert_no_blocks_held(server.healthy_worker_urls())


def test_role_switch_under_load_loses_nothing_and_answers_the_same(tmp_path, tiny_model):
    """Without the planner: ``POST /workers/{id}/role`` moves the prefill worker to decode
    while prompts are in flight through it, and back while it streams; every request
    completes, answers equal those before the switches, no KV block is left held."""
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "1", "--decode-workers", "1"),
        autoscale=False,
    ) as server:
        prompts = [text_of(500, i) for i in range(8)]
        reference = [text for text, _ in burst(server.url, prompts, 32, 1)]
        switches = []

        def switch(worker_id: str, role: str) -> None:
            response = httpx.post(
                f"{server.url}/workers/{worker_id}/role",
                json={"role": role},
                trust_env=False,
                timeout=300,
            )
            assert response.status_code == 200, response.text
            switches.append(response.json())

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(burst, server.url, prompts * 2, 32, 4)
            time.sleep(1.0)  # prefill legs in flight on prefill-0
            switch("prefill-0", "decode")
            assert pool_sizes(server) == {"prefill": 0, "decode": 2}
            during = load.result()
        assert [text for text, _ in during] == reference * 2
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(burst, server.url, prompts, 32, 4)
            time.sleep(0.5)  # streams in flight on decode-1
            switch("decode-1", "prefill")
            after = load.result() + burst(server.url, prompts, 32, 2)
        assert [text for text, _ in after] == reference * 2
        assert pool_sizes(server) == {"prefill": 1, "decode": 1}
        assert {timing["route"] for _, timing in after[-len(prompts) :]} == {"remote"}
        to_decode, to_prefill = switches
        assert (to_decode["previous_id"], to_decode["worker"]["id"]) == ("prefill-0", "decode-1")
        assert (to_prefill["previous_id"], to_prefill["worker"]["id"]) == ("decode-1", "prefill-1")
        for record in switches:
            assert record["switch_s"] < 1.0 and record["total_s"] >= record["router_drain_s"]
        # The last decode worker cannot leave its pool.
        refused = httpx.post(
            f"{server.url}/workers/decode-0/role", json={"role": "prefill"}, trust_env=False
        )
        assert refused.status_code == 409 and refused.json()["error"]["param"] == "role"
        assert_no_blocks_held(server.healthy_worker_urls())
