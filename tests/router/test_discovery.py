"""The router's pools from a provisioner (`discover`, as on a Ray cluster) and its fleet secret,
against stub workers: discovered workers join with their node, vanished ones leave rotation at
once, every leg is signed with the secret, and adding a worker by URL needs the router's API key."""

from __future__ import annotations

import httpx
import pytest

from pdserve.api.signing import parse_header
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.provision import WorkerHandle
from pdserve.router.runtime import RouterRuntime
from tests.router.harness import AppThread, router_config, start_stubs, wait_until

pytestmark = pytest.mark.slow  # stub worker processes


@pytest.fixture(scope="module")
def stubs():
    started = start_stubs(("prefill", None), ("decode", None), ("decode", None))
    yield started
    for stub in started:
        stub.stop()


def _workers(router: AppThread) -> dict[str, dict]:
    listing = httpx.get(f"{router.url}/workers", trust_env=False).json()["workers"]
    return {w["id"]: w for w in listing}


def _complete(router: AppThread, marker: str) -> httpx.Response:
    body = {"prompt": f"hello {marker}", "max_tokens": 3}
    return httpx.post(f"{router.url}/v1/completions", json=body, trust_env=False, timeout=30)


def test_discovered_workers_join_with_their_node_and_leave_when_gone(stubs):
    prefill, decode_a, decode_b = stubs
    handles = [
        WorkerHandle("prefill-0", "prefill", prefill.url, "node-p"),
        WorkerHandle("decode-0", "decode", decode_a.url, "node-a"),
    ]
    # decode-0 is configured by URL too: discovery adopts it (with its node), no duplicate.
    config = RouterConfig(prefill_urls=(), decode_urls=(decode_a.url,), health_interval_s=0.2)
    with AppThread(build_app(config, discover=lambda: list(handles))) as router:
        wait_until(lambda: len(_workers(router)) == 2, 10)
        seen = _workers(router)
        assert {w: seen[w]["node_id"] for w in seen} == {
            "prefill-0": "node-p",
            "decode-0": "node-a",
        }
        wait_until(lambda: all(w["state"] == "healthy" for w in _workers(router).values()), 10)
        assert _complete(router, "one").status_code == 200

        handles.append(WorkerHandle("decode-1", "decode", decode_b.url, "node-b"))
        wait_until(lambda: _workers(router).get("decode-1", {}).get("state") == "healthy", 10)
        del handles[1]  # decode-0's node died: gone from its provisioner
        wait_until(lambda: "decode-0" not in _workers(router), 10)
        for marker in ("two", "three"):
            assert _complete(router, marker).status_code == 200
        assert not decode_a.events_for("three") and decode_b.events_for("three")


def test_a_router_without_workers_or_discovery_is_refused():
    with pytest.raises(ValueError, match="at least one decode worker"):
        RouterRuntime(RouterConfig(prefill_urls=(), decode_urls=()))


def test_every_leg_is_signed_with_the_fleet_secret_and_urls_need_the_api_key(stubs):
    prefill, decode, _ = stubs
    config = router_config([prefill], [decode], fleet_secret="fleet-s")
    with AppThread(build_app(config)) as router:
        wait_until(lambda: all(w["state"] == "healthy" for w in _workers(router).values()), 10)
        assert _complete(router, "secret-legs").status_code == 200
        for stub in (prefill, decode):
            legs = [e for e in stub.log() if "secret-legs" in str(e["body"])]
            # Signed (the worker checks the signature), never the secret itself.
            signed = [parse_header(e["authorization"].encode()) for e in legs]
            assert legs and None not in signed
            assert not any("fleet-s" in e["authorization"] for e in legs)
        # The router would present the secret to any URL it is given: only its operator may.
        added = httpx.post(
            f"{router.url}/workers", json={"url": "http://127.0.0.1:9", "role": "decode"}
        )
        assert added.status_code == 403 and added.json()["error"]["param"] == "url"
    keyed = router_config([prefill], [decode], fleet_secret="fleet-s", api_key="ops")
    with AppThread(build_app(keyed)) as router:
        added = httpx.post(
            f"{router.url}/workers",
            json={"url": "http://127.0.0.1:9", "role": "decode"},
            headers={"Authorization": "Bearer ops"},
        )
        assert added.status_code == 201
