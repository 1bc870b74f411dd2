"""/metrics parses and moves; a client that disconnects mid-stream frees its KV blocks."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).parents[2] / "grafana" / "pdserve-dashboard.json"

REQUIRED_FAMILIES = [
    "pdserve:time_to_first_token_seconds",
    "pdserve:inter_token_latency_seconds",
    "pdserve:request_time_per_output_token_seconds",
    "pdserve:e2e_request_latency_seconds",
    "pdserve:request_queue_time_seconds",
    "pdserve:request_prefill_time_seconds",
    "pdserve:engine_step_time_seconds",
    "pdserve:num_requests_running",
    "pdserve:num_requests_waiting",
    "pdserve:kv_cache_usage_perc",
    "pdserve:kv_cache_free_blocks",
    "pdserve:prefix_cache_hit_rate",
    "pdserve:prompt_tokens_total",
    "pdserve:generation_tokens_total",
    "pdserve:num_preemptions_total",
]


def wait_for_metrics(server, predicate, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if predicate(metrics):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never satisfied the predicate: {metrics}")
        time.sleep(0.05)


def test_metrics_parse_and_counters_move(tiny_server):
    before = tiny_server.metrics()
    for name in REQUIRED_FAMILIES:
        assert any(key == name or key.startswith((name + "{", name + "_")) for key in before), name
    body = {"prompt": "count with me", "max_tokens": 7, "ignore_eos": True}
    assert tiny_server.post("/v1/completions", body).status_code == 200
    assert tiny_server.post("/v1/completions", {"prompt": ""}).status_code == 400
    after = tiny_server.metrics()

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pdserve:generation_tokens_total") == 7
    assert delta("pdserve:prompt_tokens_total") >= 1
    assert delta("pdserve:request_success_total{finished_reason=length}") == 1
    assert delta("pdserve:request_errors_total{type=invalid_request_error}") == 1
    assert delta("pdserve:time_to_first_token_seconds_count") == 1
    assert delta("pdserve:inter_token_latency_seconds_count") == 6
    assert delta("pdserve:request_time_per_output_token_seconds_count") == 1
    assert delta("pdserve:e2e_request_latency_seconds_count") == 1
    assert delta("pdserve:engine_step_time_seconds_count") >= 7
    assert delta("pdserve:engine_steps_total") == delta("pdserve:engine_step_time_seconds_count")
    assert after["pdserve:kv_cache_total_blocks"] > 0


def test_prefix_cache_hit_rate_rises_on_a_repeated_prompt(tiny_server):
    body = {"prompt": "a shared prefix " * 8, "max_tokens": 1}
    tiny_server.post("/v1/completions", body)
    before = tiny_server.metrics()["pdserve:prefix_cache_hit_rate"]
    tiny_server.post("/v1/completions", body)
    assert tiny_server.metrics()["pdserve:prefix_cache_hit_rate"] > before


# Generations the client leaves long before they could end: even a CPU many times faster
# than this one takes seconds for this many tokens of the real model.
LONG_GENERATION = 1000


def test_disconnect_mid_stream_frees_blocks(smol_server):
    before = smol_server.metrics()
    total = before["pdserve:kv_cache_total_blocks"]
    body = {
        "prompt": "tell me a very long story",
        "max_tokens": LONG_GENERATION,
        "ignore_eos": True,
        "stream": True,
    }
    num_chunks = 0
    with httpx.stream(
        "POST",
        f"{smol_server.url}/v1/completions",
        json=body,
        headers=smol_server.headers,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                num_chunks += 1
                if num_chunks == 3:
                    # Blocks are held while the request runs...
                    assert smol_server.metrics()["pdserve:kv_cache_free_blocks"] < total
                    break
    # ... and the connection closes here, mid-stream.
    after = wait_for_metrics(
        smol_server,
        lambda m: (
            m["pdserve:num_requests_running"] == 0 and m["pdserve:kv_cache_free_blocks"] == total
        ),
    )
    aborted = "pdserve:request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    generated = after["pdserve:generation_tokens_total"] - before["pdserve:generation_tokens_total"]
    assert 3 <= generated < LONG_GENERATION


def test_disconnect_during_non_streaming_request_aborts_it(smol_server):
    before = smol_server.metrics()
    total = before["pdserve:kv_cache_total_blocks"]
    body = {"prompt": "another long story", "max_tokens": LONG_GENERATION, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{smol_server.url}/v1/completions", json=body, headers=smol_server.headers, timeout=0.5
        )
    after = wait_for_metrics(
        smol_server,
        lambda m: (
            m["pdserve:num_requests_running"] == 0 and m["pdserve:kv_cache_free_blocks"] == total
        ),
    )
    aborted = "pdserve:request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert (
        after["pdserve:generation_tokens_total"] - before["pdserve:generation_tokens_total"]
        < LONG_GENERATION
    )


def test_health_and_models(tiny_server):
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{tiny_server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "tiny-alias"]
    assert models[0]["max_model_len"] == 256


def test_chat_default_max_tokens_fills_the_context(tiny_server):
    response = tiny_server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "go on forever"}], "ignore_eos": True},
    )
    usage = response.json()["usage"]
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert usage["total_tokens"] == 256


def test_grafana_dashboard_queries_only_exported_metrics(tiny_server):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 20
    referenced = {name for expr in exprs for name in re.findall(r"pdserve:[a-z0-9_]+", expr)}
    exported = {key.split("{")[0] for key in tiny_server.metrics()}
    # The shared KV store's families exist only with --kv-store (tests/kv_store checks them).
    store = {name for name in referenced if name.startswith("pdserve:kv_store_")}
    assert referenced - store <= exported, referenced - store - exported
    # Every family the server exports is on the dashboard somewhere.
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", name) for name in exported}
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in referenced}
    assert families <= shown, families - shown
