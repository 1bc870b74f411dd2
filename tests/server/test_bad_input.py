"""Bad input gets an OpenAI-style 4xx naming the field, never a 5xx, and leaves no state."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello " * 400  # > --max-model-len 256 of the tiny server

COMPLETION_CASES = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": LONG_TEXT}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 300}, "max_tokens"),  # prompt + 300 > context
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 5, "min_tokens": 10}, "min_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop[0]"),
    ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "hi", "stop": 7}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "echo": 0}, "echo"),  # exactly false, not a falsy number
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "hi", "kv_transfer_params": [1]}, "kv_transfer_params"),
]

CHAT_CASES = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}, *USER]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    (
        {"messages": [*USER, {"role": "tool", "content": "4", "tool_call_id": "c1"}]},
        "messages[1].role",
    ),
    ({"messages": [{"role": "function", "content": "4", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format.type"),
]


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param, error


@pytest.mark.parametrize(("body", "param"), COMPLETION_CASES)
def test_bad_completion_request(tiny_server, body, param):
    assert_error(tiny_server.post("/v1/completions", body), 400, param)


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
def test_bad_chat_request(tiny_server, body, param):
    assert_error(tiny_server.post("/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content", [b"{", b"[]", b'"x"', b"null", b"\xff\xfe", b""])
def test_malformed_body(tiny_server, endpoint, content):
    response = httpx.post(
        f"{tiny_server.url}{endpoint}",
        content=content,
        headers={"Content-Type": "application/json"},
    )
    assert_error(response, 400, None)


def test_unknown_model_is_404_and_aliases_work(tiny_server):
    response = tiny_server.post("/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"
    ok = tiny_server.post(
        "/v1/completions", {"prompt": "hi", "model": "tiny-alias", "max_tokens": 2}
    )
    assert ok.status_code == 200 and ok.json()["model"] == "tiny-alias"


def test_body_over_the_limit_is_413(tiny_server):
    body = b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}'
    response = httpx.post(
        f"{tiny_server.url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert_error(response, 413, None)

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a" * 2**20
        yield b'"}'

    response = httpx.post(
        f"{tiny_server.url}/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert_error(response, 413, None)


def test_unknown_route_and_method(tiny_server):
    assert_error(httpx.get(f"{tiny_server.url}/v1/nothing"), 404, None)
    assert_error(httpx.get(f"{tiny_server.url}/v1/completions"), 405, None)


def test_bad_input_leaves_no_state_behind(tiny_server):
    for body, _ in COMPLETION_CASES:
        tiny_server.post("/v1/completions", body)
    metrics = tiny_server.metrics()
    assert metrics["pdserve:num_requests_running"] == 0
    assert metrics["pdserve:num_requests_waiting"] == 0
    assert metrics["pdserve:kv_cache_free_blocks"] == metrics["pdserve:kv_cache_total_blocks"]
    assert metrics["pdserve:request_errors_total{type=invalid_request_error}"] >= len(
        COMPLETION_CASES
    )
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 5e-324},
        {"temperature": 1e-30},
        {"top_p": 1e-300},
        {"top_k": 1},
        {"top_k": 10**9},
        {"seed": -(2**63)},
        {"seed": 2**63 - 1},
        {"temperature": 2.0},
        {"stop": ["x"] * 16},
        {"stop_token_ids": [0, 49151]},
        {"min_tokens": 4},
        {"seed": 7.0, "top_k": 3.0, "n": 1.0},  # whole numbers, as JSON Schema counts them
    ],
)
def test_extreme_but_valid_sampling_params_generate(tiny_server, extra):
    response = tiny_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_unsupported_roles_are_named(tiny_server):
    body = {"messages": [*USER, {"role": "tool", "content": "4", "tool_call_id": "c1"}]}
    message = tiny_server.post("/v1/chat/completions", body).json()["error"]["message"]
    assert "'tool' messages" in message and "not support" in message, message


@pytest.mark.parametrize(
    "messages",
    [
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Name a "},
                    {"type": "text", "text": "colour."},
                ],
            }
        ],
        [*USER, {"role": "assistant"}, {"role": "user", "content": "again"}],
        [*USER, {"role": "assistant", "content": None}, {"role": "developer", "content": "short"}],
    ],
)
def test_openai_message_shapes_generate(tiny_server, messages):
    response = tiny_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
