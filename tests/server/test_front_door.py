"""The server and the router answer the same bad request with the same error (one front door,
`pdserve.api`): both real apps, in process, the server on the tiny random model.

The router answers some requests itself (bad JSON, a non-object body, a wrong `stream`, no API
key, a body too large, an unknown path) and relays a worker's answer to the rest (an unknown
model, any other bad field, a prompt over the context window); either way the client must see
exactly what a server would have said. The router's worker is a second server without the API
key (the router does not forward the client's key), as `pdserve serve --mode disagg` runs them.
"""

from __future__ import annotations

import httpx
import pytest

from pdserve.router.config import RouterConfig
from pdserve.server.app import create_app
from pdserve.server.settings import ServerSettings
from tests.router.harness import AppThread, RouterThread
from tests.server.conftest import tiny_engine

API_KEY = "front-door-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 16 * 1024
JSON = {"content-type": "application/json"}


def _chunked(num_bytes: int):
    """A body of `num_bytes` sent without Content-Length (chunked transfer encoding)."""
    yield b'{"prompt": "'
    for _ in range(num_bytes // 1024):
        yield b"x" * 1024
    yield b'"}'


# name -> (method, path, request kwargs, status). `auth` replaces the key's header; a callable
# `content` is called per request.
CASES = {
    "not_json": ("POST", "/v1/completions", {"content": b'{"prompt": "x",', "headers": JSON}, 400),
    "not_an_object": ("POST", "/v1/completions", {"json": [1, 2]}, 400),
    "stream_not_boolean": (
        "POST",
        "/v1/completions",
        {"json": {"prompt": "x", "stream": "y"}},
        400,
    ),
    "stream_checked_first": ("POST", "/v1/completions", {"json": {"stream": 1}}, 400),
    "wrong_field_type": ("POST", "/v1/completions", {"json": {"prompt": "x", "top_k": "5"}}, 400),
    "out_of_range": ("POST", "/v1/completions", {"json": {"prompt": "x", "temperature": 5}}, 400),
    "missing_messages": ("POST", "/v1/chat/completions", {"json": {"model": "tiny"}}, 400),
    "unknown_role": (
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "robot", "content": "hi"}]}},
        400,
    ),
    "unknown_model": ("POST", "/v1/completions", {"json": {"model": "gpt-9", "prompt": "x"}}, 404),
    "prompt_over_context": ("POST", "/v1/completions", {"json": {"prompt": "word " * 400}}, 400),
    "no_api_key": ("POST", "/v1/completions", {"json": {"prompt": "x"}, "auth": {}}, 401),
    "wrong_api_key": (
        "GET",
        "/v1/models",
        {"auth": {"Authorization": "Bearer nope"}},
        401,
    ),
    "body_too_large": (
        "POST",
        "/v1/completions",
        {"json": {"prompt": "x" * MAX_BODY_BYTES}},
        413,
    ),
    "chunked_body_too_large": (
        "POST",
        "/v1/completions",
        {"content": lambda: _chunked(2 * MAX_BODY_BYTES), "headers": JSON},
        413,
    ),
    "unknown_path": ("GET", "/v1/nowhere", {}, 404),
    "wrong_method": ("GET", "/v1/completions", {}, 405),
}


@pytest.fixture(scope="module")
def urls(tiny_model_dir):
    """(server URL, router URL): the same key and body limit on both."""

    def server(api_key: str | None) -> AppThread:
        settings = ServerSettings(
            served_model_names=("tiny",), api_key=api_key, max_body_bytes=MAX_BODY_BYTES
        )
        return AppThread(create_app(tiny_engine(tiny_model_dir), settings))

    with server(API_KEY) as direct, server(None) as worker:
        config = RouterConfig(
            prefill_urls=(),
            decode_urls=(worker.url,),
            api_key=API_KEY,
            max_body_bytes=MAX_BODY_BYTES,
        )
        with RouterThread(config) as router:
            yield direct.url, router.url


def _send(url: str, method: str, path: str, kwargs: dict) -> httpx.Response:
    kwargs = dict(kwargs)
    if callable(kwargs.get("content")):
        kwargs["content"] = kwargs["content"]()  # a generator is used up by one request
    headers = {**kwargs.pop("auth", AUTH), **kwargs.pop("headers", {})}
    with httpx.Client(trust_env=False, timeout=60) as client:
        return client.request(method, f"{url}{path}", headers=headers, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_server_and_router_give_identical_error_bodies(urls, case):
    method, path, kwargs, status = CASES[case]
    server, router = (_send(url, method, path, kwargs) for url in urls)
    assert server.status_code == status, server.text
    assert router.status_code == status, router.text
    body = server.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert router.json() == body
    assert router.headers.get("www-authenticate") == server.headers.get("www-authenticate")


def test_a_good_request_passes_both(urls):
    for url in urls:
        response = _send(
            url, "POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}}
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
