"""Pure parts of the router: load scraping, SSE framing, leg bodies, prompt token ids."""

from __future__ import annotations

import asyncio
import json
import threading

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from pdserve.kv_transfer import KVTransferParams
from pdserve.router import handoff
from pdserve.router.handoff import decode_leg_body, prefill_leg_body, wants_usage
from pdserve.router.health import parse_worker_load
from pdserve.router.prefix_index import PromptInfo
from pdserve.router.relay import is_done_event, iter_sse_events
from pdserve.router.tokenizer import LocalTokenizer, literal_token_ids, tokenize_request_body


def test_load_scrape_sums_label_sets_and_ignores_look_alikes():
    text = "\n".join(
        [
            "# HELP pdserve:num_requests_running Running requests",
            'pdserve:num_requests_running{model_name="a"} 2.0',
            'pdserve:num_requests_running{model_name="b, c"} 1.0 1700000000',
            "pdserve:num_requests_running_total 99",
            "pdserve:kv_cache_usage_perc 0.5",
        ]
    )
    load = parse_worker_load(text)
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (3, None, 0.5)


def collect(chunks: list[bytes]) -> list[bytes]:
    async def run() -> list[bytes]:
        async def source():
            for chunk in chunks:
                yield chunk

        return [event async for event in iter_sse_events(source())]

    return asyncio.run(run())


def test_sse_events_are_reassembled_across_chunks_bytes_unchanged():
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'
    events = collect([stream[:5], stream[5:20], stream[20:]])
    assert b"".join(events) == stream and len(events) == 3
    assert is_done_event(events[-1]) and not is_done_event(events[0])


def test_a_partial_trailing_event_is_dropped():
    assert collect([b'data: {}\n\ndata: {"trunc']) == [b"data: {}\n\n"]


def test_prefill_leg_is_one_token_no_stream_and_asks_for_remote_decode():
    body = {
        "prompt": "x",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "kv_transfer_params": {"forged": True},
        "router_timing": {"forged": 1},
    }
    leg = prefill_leg_body(body)
    assert leg == {
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 50  # the client's body is untouched


def test_decode_leg_is_the_original_request_plus_params_and_timing():
    body = {
        "prompt": "x",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"foo": 1},
        "kv_transfer_params": {"forged": True},
    }
    params = {"do_remote_prefill": True, "remote_block_ids": [3]}
    leg = decode_leg_body(body, params, {"prefill_ms": 2.0}, force_usage=True)
    assert leg["kv_transfer_params"] == params and leg["router_timing"] == {"prefill_ms": 2.0}
    assert leg["stream_options"] == {"foo": 1, "include_usage": True}
    assert not wants_usage(body) and wants_usage(leg)
    local = decode_leg_body(body, None, {}, force_usage=False)
    assert "kv_transfer_params" not in local and local["stream_options"] == {"foo": 1}


def test_prompt_token_ids_given_literally_and_tokenize_bodies():
    assert literal_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert literal_token_ids({"prompt": [[4, 5]]}) == [4, 5]
    assert literal_token_ids({"prompt": "text"}) is None
    assert tokenize_request_body("/v1/completions", {"prompt": ["hi"], "model": "m"}) == {
        "prompt": "hi",
        "model": "m",
    }
    chat = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    assert tokenize_request_body("/v1/chat/completions", chat) == {
        "messages": chat["messages"],
        "add_generation_prompt": False,
    }
    assert tokenize_request_body("/v1/completions", {"prompt": ["a", "b"]}) is None


def test_prompt_info_hashes_full_blocks_or_estimates_length():
    info = PromptInfo.from_token_ids(list(range(40)), block_size=16)
    assert (info.num_tokens, len(info.block_hashes)) == (40, 2)
    guess = PromptInfo.estimate({"prompt": "x" * 400})
    assert guess.block_hashes == () and 90 <= guess.num_tokens <= 110


def test_local_tokenizer_renders_chat_like_the_server(tmp_path):
    vocab = {
        w: i for i, w in enumerate(["[UNK]", "<s>", "hello", "world", "user", "system", "bot"])
    }
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}bot {% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = LocalTokenizer.load(str(tmp_path))

    def ids(endpoint: str, body: dict) -> list[int] | None:
        return asyncio.run(tokenizer.token_ids(endpoint, body))

    assert ids("/v1/completions", {"prompt": "hello world"}) == [2, 3]
    messages = [
        {"role": "developer", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "world"}]},
    ]
    assert ids("/v1/chat/completions", {"messages": messages}) == [5, 2, 4, 3, 6]


def test_unclaimed_kv_releases_in_flight_are_bounded(monkeypatch):
    unblock = threading.Event()
    calls = []

    def stuck_release(params, timeout, secret=None, tls=None):  # a KV port that never answers
        calls.append(params.remote_request_id)
        unblock.wait(30)
        return True

    monkeypatch.setattr(handoff, "release_lease", stuck_release)
    monkeypatch.setattr(handoff, "MAX_PENDING_RELEASES", 3)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="e",
        remote_request_id="r",
        remote_host="127.0.0.1",
        remote_port=9,
        remote_block_ids=(0,),
        remote_num_tokens=1,
        layout_hash="h",
        transport="tcp",
    ).to_dict()

    async def storm() -> int:
        unclaimed = handoff.UnclaimedKV(timeout_s=1.0)
        for index in range(10):
            unclaimed.release({**params, "remote_request_id": f"r{index}"})
        pending = len(unclaimed._tasks)
        unblock.set()
        while unclaimed._tasks:
            await asyncio.sleep(0.01)
        return pending

    assert asyncio.run(storm()) == 3
    assert sorted(calls) == ["r0", "r1", "r2"]  # the rest are left to their lease timeout
