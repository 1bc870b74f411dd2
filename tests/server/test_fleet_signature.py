"""A fleet worker's HTTP answers only requests its router signed (`api.signing`): the secret
itself is never sent, a signature is good for its own method, host, path and body only, within
the clock window, and once; ``/health`` stays open."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI, Request

from pdserve.api import signing
from pdserve.api.asgi import install_front_door
from pdserve.api.signing import FleetAuth, ReplayGuard
from tests.router.harness import AppThread

SECRET = "worker-fleet-secret"


def _worker_app() -> FastAPI:
    app = FastAPI()
    install_front_door(
        app, api_key=None, protected_prefixes=("/v1",), max_body_bytes=4096, fleet_secret=SECRET
    )

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return await request.json()

    @app.get("/metrics")
    async def metrics() -> dict:
        return {"scraped": True}

    return app


@pytest.fixture(scope="module")
def worker():
    with AppThread(_worker_app()) as app:
        yield app


def _signed(url: str, method: str = "POST", path: str = "/v1/echo", **kwargs) -> httpx.Request:
    """A request as the router's client would send it, its Authorization header set."""
    request = httpx.Client().build_request(method, f"{url}{path}", **kwargs)
    return next(FleetAuth(SECRET).auth_flow(request))


def _send(request: httpx.Request) -> httpx.Response:
    with httpx.Client(trust_env=False) as client:
        return client.send(request)


def test_signed_requests_pass_and_carry_no_secret(worker):
    with httpx.Client(auth=FleetAuth(SECRET), trust_env=False) as router:
        answer = router.post(f"{worker.url}/v1/echo", json={"n": 1})
        assert answer.status_code == 200 and answer.json() == {"n": 1}
        assert router.get(f"{worker.url}/metrics?format=text").json() == {"scraped": True}
        assert SECRET not in answer.request.headers["Authorization"]
    assert httpx.get(f"{worker.url}/health", trust_env=False).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": f"Bearer {SECRET}"}, {"Authorization": "Fleet t=1, n=ab, s=00"}],
)
def test_unsigned_or_badly_signed_requests_are_refused(worker, headers):
    answer = httpx.post(f"{worker.url}/v1/echo", json={"n": 1}, headers=headers, trust_env=False)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"


def test_a_replayed_request_is_refused(worker):
    request = _signed(worker.url, json={"n": 2})
    assert _send(request).status_code == 200
    again = _send(request)
    assert again.status_code == 401
    assert "replayed" in again.json()["error"]["message"]


def test_a_signature_covers_method_host_path_and_body(worker):
    original = _signed(worker.url, json={"n": 3})
    host = worker.url.replace("127.0.0.1", "localhost")
    for method, url, content in [
        ("POST", f"{worker.url}/v1/echo", b'{"n":4}'),  # another body
        ("POST", f"{worker.url}/v1/echo?x=1", original.content),  # another path
        ("PUT", f"{worker.url}/v1/echo", original.content),  # another method
        ("POST", f"{host}/v1/echo", original.content),  # aimed at another host name
    ]:
        forged = httpx.Request(method, url, content=content, headers=original.headers)
        forged.headers["Host"] = url.split("/")[2]
        answer = _send(forged)
        assert answer.status_code == 401, (method, url)
        assert "wrong fleet signature" in answer.json()["error"]["message"]
    assert _send(original).status_code == 200  # the untouched one still passes, once


def test_a_signature_from_outside_the_clock_window_is_refused(worker, monkeypatch):
    skewed = time.time() - signing.MAX_CLOCK_SKEW_S - 5
    monkeypatch.setattr(signing.time, "time", lambda: skewed)
    request = _signed(worker.url, json={"n": 5})
    monkeypatch.undo()
    answer = _send(request)
    assert answer.status_code == 401 and "clock window" in answer.json()["error"]["message"]


def test_the_replay_guard_is_bounded_and_refuses_what_it_forgot():
    guard = ReplayGuard(window_s=30.0, capacity=4)
    now = 1000.0
    for i in range(10):
        assert guard.admit(f"n{i}", now + i * 0.01, now + 0.1)
    assert len(guard) == 4
    # n0 was forgotten: its replay is refused all the same (signed at or before the floor).
    assert not guard.admit("n0", now, now + 0.1)
    assert not guard.admit("n9", now + 0.09, now + 0.1)  # remembered
    assert guard.admit("fresh", now + 0.2, now + 0.2)
    # Nonces whose requests left the window are dropped on the next admission.
    assert guard.admit("later", now + 100, now + 100) and len(guard) == 1
