"""`pdserve serve --mode chunked --data-parallel-size 2` on real workers: two pinned engine
processes behind the router. Requests spread over both; one replica killed under load takes
only its own streams with it, the rest complete and new requests go to the survivor, which
holds no KV blocks afterwards."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pdserve.bench.processes import metric_values
from tests.router.harness import wait_until
from tests.router.real_workers import Routed, assert_no_blocks_held, stream_tokens

pytestmark = pytest.mark.slow

NUM_STREAMS = 4
# The streams must outlast starting them all and the kill by far, however fast the CPU:
# sized from this machine's pace (`stream_tokens`), within these bounds (the context).
STREAM_TOKENS = (120, 2000)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    server = Routed(
        tmp_path_factory.mktemp("replicas"), "dp", "--mode", "chunked", "--data-parallel-size", "2"
    )
    try:
        server.wait_healthy()
        wait_until(lambda: len(server.healthy_worker_urls()) == 2, 60, "two healthy replicas")
        yield server
    finally:
        server.process.stop()


def _client(server: Routed) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def test_the_replicas_are_plain_servers_of_the_mode_in_one_pool(replicas):
    workers = replicas.workers()
    assert sorted(workers) == ["decode-0", "decode-1"]
    for worker_id in workers:
        cmdline = Path(f"/proc/{replicas.worker_pid(worker_id)}/cmdline")
        argv = cmdline.read_text().split("\0")
        assert argv[argv.index("--mode") + 1] == "chunked"
        assert "--role" not in argv  # no KV transfer: a whole server


def test_requests_spread_over_the_replicas(replicas):
    client = _client(replicas)
    model = client.models.list().data[0].id

    def complete(i: int) -> str:
        answer = client.completions.create(model=model, prompt=f"Count to {i}:", max_tokens=8)
        return answer.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        assert all(list(pool.map(complete, range(8))))
    served = [
        metric_values(url).get("pdserve:request_success_total", 0.0)
        for url in replicas.healthy_worker_urls()
    ]
    assert len(served) == 2 and all(n > 0 for n in served), served


def _all_idle(server: Routed) -> bool:
    return all(
        not w["num_inflight"] and not w["num_running"] and not w["num_waiting"]
        for w in server.workers().values()
    )


def test_a_killed_replica_loses_only_its_own_requests(replicas):
    client = _client(replicas)
    model = client.models.list().data[0].id
    num_tokens = stream_tokens(replicas.url, "Story 0:", STREAM_TOKENS)
    outcomes: dict[int, object] = {}
    streaming = [threading.Event() for _ in range(NUM_STREAMS)]

    def stream(i: int) -> None:
        tokens = 0
        try:
            for chunk in client.completions.create(
                model=model,
                prompt=f"Story {i}:",
                max_tokens=num_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                if chunk.usage is not None:  # the last chunk: every token was streamed
                    tokens = chunk.usage.completion_tokens
                streaming[i].set()
            outcomes[i] = tokens
        except openai.APIError as exc:
            outcomes[i] = exc
        finally:
            streaming[i].set()

    # The policy takes the larger of a worker's scraped and in-flight counts: a scrape taken
    # during the pace probe or the previous test would tip the alternation while it is stale.
    wait_until(lambda: _all_idle(replicas), 60, "both replicas' scraped loads idle")
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
    for thread, started in zip(threads, streaming, strict=True):
        thread.start()  # one at a time: least-loaded alternates between the replicas
        assert started.wait(300)
    on_victim = replicas.workers()["decode-0"]["num_inflight"]
    assert on_victim == NUM_STREAMS // 2
    os.kill(replicas.worker_pid("decode-0"), signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=600)
    completed = [n for n in outcomes.values() if n == num_tokens]
    assert len(completed) == NUM_STREAMS - on_victim, outcomes
    wait_until(lambda: replicas.workers()["decode-0"]["state"] == "unhealthy", 30)
    after = client.completions.create(model=model, prompt="After:", max_tokens=4)
    assert after.choices[0].finish_reason is not None
    assert_no_blocks_held(replicas.healthy_worker_urls())
