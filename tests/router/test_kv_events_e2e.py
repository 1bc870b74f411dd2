"""KV events from real workers: two routers' prefix indexes stay equal to what the workers'
block managers hold (``GET /kv/blocks``) through eviction, a role switch, a restart and a lost
event, and the second router routes as the first would."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.api.signing import FleetAuth
from pdserve.fleet import FLEET_SECRET_ENV
from pdserve.ports import free_port
from pdserve.router.config import RouterConfig
from tests.router.harness import ManagedProcess, RouterThread, wait_until

pytestmark = pytest.mark.slow

SECRET = "kv-events-fleet-secret"
API_KEY = "kv-events-operator"
# 24 blocks of 16 tokens: a few prompts fill it, so later ones evict earlier ones' blocks.
WORKER_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "24", "--max-num-seqs", "4")
WORKER_FLAGS += ("--num-threads", "1", "--role", "decode", "--kv-transport", "tcp")


class Worker:
    def __init__(self, log_dir: Path, name: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port)]
        self.process = ManagedProcess(
            [*argv, *WORKER_FLAGS], log_dir / f"{name}.log", env={FLEET_SECRET_ENV: SECRET}
        )

    def cached(self) -> set[int]:
        response = httpx.get(
            f"{self.url}/kv/blocks",
            auth=FleetAuth(SECRET),
            trust_env=False,
            timeout=30,
        )
        assert response.status_code == 200, response.text
        return set(response.json()["block_hashes"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[list[Worker], list[RouterThread]]]:
    logs = tmp_path_factory.mktemp("kv-events")
    workers = [Worker(logs, f"w{i}") for i in range(2)]
    try:
        for worker in workers:
            worker.process.wait_healthy(f"{worker.url}/health", 900)
        config = RouterConfig(
            prefill_urls=(),
            decode_urls=tuple(w.url for w in workers),
            decode_policy="prefix_aware",
            local_prefill_threshold=1 << 20,
            health_interval_s=0.2,
            api_key=API_KEY,
            fleet_secret=SECRET,
        )
        with contextlib.ExitStack() as stack:
            routers = [stack.enter_context(RouterThread(config)) for _ in range(2)]
            yield workers, routers
    finally:
        for worker in workers:
            worker.process.stop()


def _complete(router: RouterThread, prompt: str) -> dict:
    response = httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        trust_env=False,
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return json.loads(response.headers["x-pdserve-timing"])


def _indexed(router: RouterThread, url: str) -> set[int]:
    return set(router.runtime.registry.decode.prefix_index._blocks.get(url, ()))


def _assert_indexes_equal_caches(workers: list[Worker], routers: list[RouterThread]) -> None:
    for worker in workers:
        for router in routers:
            wait_until(
                lambda w=worker, r=router: _indexed(r, w.url) == w.cached(),
                60.0,
                f"router index of {worker.url} to equal its cache",
                interval_s=0.1,
            )


def _prompt(topic: int, question: int) -> str:
    system = f"System prompt {topic}: " + " ".join(f"rule {topic}.{i}" for i in range(40))
    return f"{system}\nQuestion {question}: what is {question} plus {topic}?"


def test_indexes_follow_eviction_and_the_second_router_routes_alike(fleet):
    workers, (first, second) = fleet
    # 6 prompts of ~12 blocks through both routers, into 2 x 24 blocks: evictions.
    for i in range(6):
        _complete((first, second)[i % 2], _prompt(i, i))
    _assert_indexes_equal_caches(workers, [first, second])
    evicted = _complete(first, _prompt(0, 0))
    assert evicted["predicted_hit_tokens"] == evicted["hit_tokens"] < 10 * 16
    # A prefix new to both: whichever router sent it, the other sees where it is cached.
    timing = _complete(first, _prompt(9, 1))
    _assert_indexes_equal_caches(workers, [first, second])
    again = _complete(second, _prompt(9, 2))
    assert again["decode_worker"] == timing["decode_worker"]
    assert again["predicted_hit_tokens"] == again["hit_tokens"] > 0


def test_role_switch_restart_and_a_lost_event_leave_the_indexes_equal(fleet, tmp_path):
    workers, routers = fleet
    first = routers[0]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for role in ("prefill", "decode"):
        worker_id = next(
            w["id"] for w in first.workers(headers).values() if w["url"] == workers[1].url
        )
        response = httpx.post(
            f"{first.url}/workers/{worker_id}/role",
            json={"role": role},
            headers=headers,
            trust_env=False,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        _complete(first, _prompt(5, 5))
        _assert_indexes_equal_caches(workers, routers)
    # Restart: a new process on the same port is a new epoch, answered with a snapshot.
    workers[1].process.stop()
    restarted = Worker(tmp_path, "w1-restarted", port=workers[1].port)
    workers[1].process = restarted.process
    restarted.process.wait_healthy(f"{restarted.url}/health", 900)
    _assert_indexes_equal_caches(workers, routers)
    for i in range(2):
        _complete(routers[i], _prompt(6, i))
    _assert_indexes_equal_caches(workers, routers)
    # A lost event: the second router's next event from w0 will not follow its position.
    subscriber = routers[1].runtime.kv_events
    num_gaps = subscriber.num_gaps
    subscriber._positions[workers[0].url].seq -= 1
    routers[1].runtime.registry.decode.prefix_index._blocks[workers[0].url].clear()
    # Sent to w0 past both routers (as another router would): its events still reach them.
    response = httpx.post(
        f"{workers[0].url}/v1/completions",
        json={"prompt": _prompt(11, 1), "max_tokens": 2},
        auth=FleetAuth(SECRET),
        trust_env=False,
        timeout=300,
    )
    assert response.status_code == 200, response.text
    _assert_indexes_equal_caches(workers, routers)
    assert subscriber.num_gaps > num_gaps
