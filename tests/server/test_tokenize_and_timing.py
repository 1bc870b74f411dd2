"""POST /tokenize and `pdserve_timing`, on the tiny random model, in process.

/tokenize must give exactly the ids the generation endpoints compute (the router hashes them
into prefix-cache blocks): checked by generating from those ids and from the text/messages
and comparing the greedy outputs (random weights: different ids give different outputs), and
against the router's own tokenizer. `pdserve_timing` comes back only to routed requests (they
carry `router_timing`), in the usage chunk of a stream and the body of a plain answer.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pdserve.router.tokenizer import LocalTokenizer
from pdserve.server.app import create_app
from pdserve.server.settings import ServerSettings
from tests.server.conftest import tiny_engine

MESSAGES = [
    {"role": "developer", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}],
    },
]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    app = create_app(tiny_engine(tiny_model_dir), ServerSettings(served_model_names=("tiny",)))
    with TestClient(app) as test_client:
        yield test_client


def _tokens(client: TestClient, body: dict) -> list[int]:
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 256
    return answer["tokens"]


def _completion(client: TestClient, prompt) -> dict:
    response = client.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_prompt_gives_the_completion_ids(client, tiny_model_dir):
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = _tokens(client, {"prompt": prompt, "model": "tiny"})
    by_text, by_ids = _completion(client, prompt), _completion(client, ids)
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    router_ids = asyncio.run(
        LocalTokenizer.load(str(tiny_model_dir)).token_ids("/v1/completions", {"prompt": prompt})
    )
    assert router_ids == ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_gives_the_chat_ids(client, tiny_model_dir, add_generation_prompt):
    body = {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
    ids = _tokens(client, body)
    chat = client.post("/v1/chat/completions", json={**body, **GREEDY})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    assert (
        chat.json()["choices"][0]["message"]["content"]
        == _completion(client, ids)["choices"][0]["text"]
    )
    router_ids = asyncio.run(
        LocalTokenizer.load(str(tiny_model_dir)).token_ids("/v1/chat/completions", body)
    )
    assert router_ids == ids


def test_tokenize_prompt_longer_than_the_context_is_counted(client):
    assert len(_tokens(client, {"prompt": "word " * 400})) > 256


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "model": "other"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({}, 400, "prompt"),
        ({"prompt": "hi", "messages": MESSAGES}, 400, "prompt"),
    ],
)
def test_tokenize_bad_input_is_a_clear_error(client, body, status, param):
    response = client.post("/tokenize", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    if param is not None:
        assert param in (error["param"] or "") + error["message"]


ROUTER_TIMING = {"router_queue_ms": 1.5, "prefill_ms": 0.0, "note": "ignored", "flag": True}


def _check_timing(timing: dict) -> None:
    assert timing["router_queue_ms"] == 1.5 and timing["prefill_ms"] == 0.0
    assert "note" not in timing and "flag" not in timing  # only numbers are echoed
    assert timing["kv_transfer_bytes"] == 0 and timing["kv_transfer_ms"] == 0.0
    assert timing["worker_prefill_ms"] > 0 and timing["worker_queue_ms"] >= 0
    assert timing["first_decode_step_ms"] > 0 and timing["worker_ttft_ms"] > 0


def test_pdserve_timing_in_a_routed_plain_answer(client):
    body = {"prompt": "Hello there", **GREEDY}
    assert "pdserve_timing" not in client.post("/v1/completions", json=body).json()
    routed = client.post("/v1/completions", json={**body, "router_timing": ROUTER_TIMING})
    _check_timing(routed.json()["pdserve_timing"])


def test_pdserve_timing_in_a_routed_streams_usage_chunk(client):
    body = {
        "messages": MESSAGES,
        **GREEDY,
        "stream": True,
        "stream_options": {"include_usage": True},
        "router_timing": ROUTER_TIMING,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [
            json.loads(line[len("data: ") :])
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    assert [e for e in events if "pdserve_timing" in e] == [events[-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    _check_timing(events[-1]["pdserve_timing"])


def test_router_timing_must_be_an_object(client):
    response = client.post("/v1/completions", json={"prompt": "Hi", "router_timing": [1]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "router_timing"
