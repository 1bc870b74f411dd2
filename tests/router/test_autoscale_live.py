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
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.harness import http, wait_until
from tests.router.real_workers import (
    Disagg,
    answer_text,
    assert_no_blocks_held,
    request_times,
)
from tests.server.conftest import write_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one per worker"),
]

INTERVAL_S = 0.5
GRACE_S = 2.0
# Any TTFT is over this SLO, however fast the CPU (the histogram's p90 is never below it).
ALWAYS_MISSED_TTFT = "ttft:0.001"
# The decode pressure tests: sequences per decode worker, and how many requests its engine
# must hold for a queue (`AutoscaleConfig.queue_high`: over 2 waiting per worker), with room
# to spare: the queue must be there whenever the planner samples it.
MAX_NUM_SEQS = 2
NUM_IN_ENGINE = 2 * (MAX_NUM_SEQS + 3)
# Bounds of the measured load: the model's context (1024) less the prompt, and the clients
# this test process and the router can drive.
MAX_TOKENS = (64, 800)
MAX_CLIENTS = 48
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


@dataclass(frozen=True)
class DecodeLoad:
    """Long generations that keep a decode worker's queue full on this machine: `max_tokens`
    each, from `concurrency` clients (`decode_load`)."""

    max_tokens: int
    concurrency: int
    measured: str  # what it was sized from, for failure messages


def measure_decode_load(url: str) -> DecodeLoad:
    """The decode pressure tests' load, sized from this machine's request times on `url`, a
    deployment with one decode worker of MAX_NUM_SEQS and nothing else to do: a client
    spends only part of each request in the engine (the rest in HTTP, the router,
    tokenizing), and a CPU whose kernels outrun its HTTP stack spends less. So the
    generations are made long enough that engine time is about nine tenths of a request,
    and the clients enough to keep NUM_IN_ENGINE in the engine, within MAX_TOKENS and
    MAX_CLIENTS. One request at a time: no queue, nothing for a planner to act on."""
    overhead_s, token_s = request_times(url, text_of(20, 0))
    low, high = MAX_TOKENS
    max_tokens = min(high, max(low, math.ceil(9 * overhead_s / token_s)))
    engine_share = max_tokens * token_s / (max_tokens * token_s + overhead_s)
    concurrency = min(MAX_CLIENTS, math.ceil(NUM_IN_ENGINE / engine_share))
    measured = (
        f"a request {overhead_s * 1000:.1f} ms besides {token_s * 1000:.2f} ms per token: "
        f"{concurrency} clients x {max_tokens} tokens, {engine_share:.0%} in the engine"
    )
    print(measured)
    return DecodeLoad(max_tokens, concurrency, measured)


@pytest.fixture(scope="module")
def decode_load(tmp_path_factory, tiny_model) -> DecodeLoad:
    """`measure_decode_load` on a deployment of its own (the tests' pools are busy or idle
    in ways a planner would act on while it measured)."""
    with deployment(
        tmp_path_factory.mktemp("decode-load"),
        tiny_model,
        *("--prefill-workers", "0", "--decode-workers", "1"),
        *("--worker-args", f"--max-num-seqs {MAX_NUM_SEQS}"),
        autoscale=False,
    ) as server:
        return measure_decode_load(server.url)


def burst(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[tuple]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens), prompts))


class Load:
    """Every request `keep_sending` sent, by index: its prompt, then its answer (text and
    routing header) or why it failed."""

    def __init__(self) -> None:
        self.prompts: dict[int, str] = {}
        self.answers: dict[int, tuple[str, dict]] = {}
        self.failures: dict[int, str] = {}

    def latest(self) -> tuple[str, dict] | None:
        """The answer to the last request sent that has one."""
        done = sorted(self.answers)
        return self.answers[done[-1]] if done else None

    def in_order(self) -> list[tuple[str, dict]]:
        return [self.answers[i] for i in sorted(self.answers)]

    def assert_all_answered(self, expected: dict[str, str] | None) -> None:
        """None failed, every request sent was answered in full, and with the expected text:
        `expected[prompt]`, or (None) the same text for every request of the same prompt."""
        assert not self.failures, self.failures
        assert self.answers and sorted(self.answers) == sorted(self.prompts)
        texts: dict[str, set[str]] = {}
        for i, (text, _) in self.answers.items():
            texts.setdefault(self.prompts[i], set()).add(text)
        for prompt, answered in texts.items():
            assert len(answered) == 1, (prompt, answered)
            if expected is not None:
                assert answered == {expected[prompt]}, prompt


@contextlib.contextmanager
def keep_sending(
    url: str,
    request: Callable[[int], tuple[str, int]],
    concurrency: int,
    expected: dict[str, str] | None = None,
) -> Iterator[Load]:
    """Greedy completions (`request(i)`: prompt and max_tokens) sent back to back by
    `concurrency` clients while the block runs, so the load lasts until the condition the
    block waits for holds, however fast this machine computes. After the block every client
    finishes its request, and every request sent must have been answered in full with the
    expected text (`Load.assert_all_answered`)."""
    load = Load()
    stop = threading.Event()
    counter = itertools.count()

    def client() -> None:
        while not stop.is_set():
            i = next(counter)
            prompt, max_tokens = request(i)
            load.prompts[i] = prompt
            try:
                load.answers[i] = complete(url, prompt, max_tokens)
            except Exception as error:  # counted, and asserted none after the block
                load.failures[i] = repr(error)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        yield load
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a client never finished"
    load.assert_all_answered(expected)


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


def served_by(load: Load) -> set[str]:
    """The decode workers that answered the load's requests so far."""
    return {timing["decode_worker"] for _, timing in list(load.answers.values())}


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
    # No prefill worker at first: the decode worker prefills, and any TTFT is over the SLO.
    # Room for one prefill worker beside it.
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "0", "--decode-workers", "1", "--max-prefill-workers", "1"),
        *("--max-decode-workers", "1", "--slo", f"{ALWAYS_MISSED_TTFT},itl:100000"),
    ) as server:
        # Bursts until the planner acts: a fast CPU prefills a burst within one interval.
        with keep_sending(server.url, lambda i: (text_of(600, i), 2), concurrency=3) as load:
            wait_for(server, "a prefill worker", lambda: pool_sizes(server)["prefill"] == 1)
        assert load.in_order()[0][1]["route"] == "local"
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
    it is drained and stopped mid-traffic; every request completes, with the same answer
    prefilled there or locally."""
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "1", "--decode-workers", "1", "--max-prefill-workers", "1"),
        *("--max-decode-workers", "1", "--slo", "ttft:60000,itl:100000"),
    ) as server:
        prefill_pid = server.worker_pid("prefill-0")
        with keep_sending(server.url, lambda i: (text_of(300, i), 24), concurrency=1) as load:
            wait_for(
                server, "the prefill worker drained", lambda: pool_sizes(server)["prefill"] == 0
            )
            # Requests keep flowing, prefilled locally now.
            wait_until(
                lambda: (load.latest() or ("", {}))[1].get("route") == "local",
                300,
                "an answer prefilled locally",
            )
        routes = [timing["route"] for _, timing in load.in_order()]
        assert "remote" in routes and routes[-1] == "local", routes
        assert decisions(server) == [("remove", "prefill", "idle")]
        wait_until(lambda: not Path(f"/proc/{prefill_pid}").exists(), 60, "prefill-0 to exit")
        assert_no_blocks_held(server.healthy_worker_urls())


def test_a_burst_of_long_generations_grows_the_decode_pool(tmp_path, tiny_model, decode_load):
    # Two sequences per decode worker and more clients: long generations wait (a queue is
    # over two per worker), which is pressure for as long as the clients keep sending.
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "0", "--decode-workers", "1", "--max-prefill-workers", "0"),
        *("--max-decode-workers", "2", "--slo", "ttft:60000,itl:100000"),
        *("--worker-args", f"--max-num-seqs {MAX_NUM_SEQS}"),
    ) as server:
        with keep_sending(
            server.url,
            lambda i: (text_of(20, i), decode_load.max_tokens),
            concurrency=decode_load.concurrency,
        ) as load:
            wait_for(
                server,
                f"a second decode worker ({decode_load.measured})",
                lambda: pool_sizes(server)["decode"] == 2,
            )
            # While the load lasts (once it ends, the pool is soon drained back to one), the
            # new worker answers some of it.
            wait_for(
                server, "answers from both", lambda: served_by(load) == {"decode-0", "decode-1"}
            )
        assert decisions(server)[0] == ("add", "decode", "queue")
        # Quiet now: the pool drains back to one, and what is left holds no KV.
        wait_for(server, "the decode pool to shrink", lambda: len(server.workers()) == 1)
        assert decisions(server)[-1] == ("remove", "decode", "idle")
        assert_paced(server)
        assert_no_blocks_held(server.healthy_worker_urls())


def test_the_planner_switches_an_idle_prefill_worker_to_a_saturated_decode_pool(
    tmp_path, tiny_model, decode_load
):
    # Both cores are taken (1 + 1), so the decode pool can grow only by a switch.
    with deployment(
        tmp_path,
        tiny_model,
        *("--prefill-workers", "1", "--decode-workers", "1", "--max-prefill-workers", "1"),
        *("--max-decode-workers", "2", "--slo", "ttft:60000,itl:100000"),
        *("--worker-args", f"--max-num-seqs {MAX_NUM_SEQS}"),
    ) as server:
        # Short prompts, long generations: the decode worker is the bottleneck, from the start
        # (the idle prefill worker would be drained after a few quiet ticks, not switched).
        # Every prompt gets one answer, whichever worker gave it, before the switch or after.
        with keep_sending(
            server.url,
            lambda i: (text_of(20, i), decode_load.max_tokens),
            concurrency=decode_load.concurrency,
        ):
            wait_for(
                server,
                f"a switch to decode ({decode_load.measured})",
                lambda: pool_sizes(server)["decode"] == 2,
            )
            # Its address, while it is decode-1 (once quiet the planner may move it again).
            switched = server.worker_url("decode-1")
        assert decisions(server)[0] == ("switch", "decode", "queue")
        (outcome,) = autoscale_state(server)["outcomes"]
        assert outcome["previous_id"] == "prefill-0" and outcome["worker"]["id"] == "decode-1"
        # Through the router (prefilled locally now) and at the switched worker itself, the
        # answers are those of the worker that never switched.
        checks = [text_of(200, i) for i in range(4)]
        reference = [text for text, _ in burst(server.worker_url("decode-0"), checks, 48, 1)]
        assert [text for text, _ in burst(server.url, checks, 48, 4)] == reference
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
        expected = dict(zip(prompts, reference, strict=True))
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

        def in_flight_at(worker_id: str) -> bool:
            return server.workers()[worker_id]["num_inflight"] > 0

        def request(i: int) -> tuple[str, int]:
            return prompts[i % len(prompts)], 32

        pid = server.worker_pid("prefill-0")
        with keep_sending(server.url, request, concurrency=4, expected=expected):
            wait_until(lambda: in_flight_at("prefill-0"), 300, "prefill legs on prefill-0")
            switch("prefill-0", "decode")
            assert pool_sizes(server) == {"prefill": 0, "decode": 2}
            assert server.worker_pid("decode-1") == pid  # in place: the same process
        with keep_sending(server.url, request, concurrency=4, expected=expected):
            wait_until(lambda: in_flight_at("decode-1"), 300, "streams on decode-1")
            switch("decode-1", "prefill")
        after = burst(server.url, prompts, 32, 2)
        assert [text for text, _ in after] == reference
        assert pool_sizes(server) == {"prefill": 1, "decode": 1}
        assert {timing["route"] for _, timing in after} == {"remote"}
        to_decode, to_prefill = switches
        assert (to_decode["previous_id"], to_decode["worker"]["id"]) == ("prefill-0", "decode-1")
        assert (to_prefill["previous_id"], to_prefill["worker"]["id"]) == ("decode-1", "prefill-1")
        assert server.worker_pid("prefill-1") == pid
        for record in switches:
            # The parts add up (the worker's own clock times its part of the POST).
            worker_s = record["worker_drain_s"] + record["switch_s"]
            assert record["total_s"] >= record["router_drain_s"] + worker_s - 1e-3
        # The last decode worker cannot leave its pool.
        refused = httpx.post(
            f"{server.url}/workers/decode-0/role", json={"role": "prefill"}, trust_env=False
        )
        assert refused.status_code == 409 and refused.json()["error"]["param"] == "role"
        assert_no_blocks_held(server.healthy_worker_urls())
