"""Admission control (429 + Retry-After) and SIGTERM: final abort events, exit status 0."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

LONG = {
    "prompt": "Once upon a time",
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def test_overload_then_graceful_shutdown(tmp_path):
    # One running sequence and one waiting slot: the third request has nowhere to go.
    server = start_server(
        tmp_path, "--max-num-seqs", "1", "--max-queue", "1", "--shutdown-grace", "0"
    )
    try:
        with (
            httpx.Client(base_url=server.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=LONG) as running,
        ):
            running_events = events(running)
            first = json.loads(next(running_events))
            assert first["choices"][0]["text"] is not None
            with client.stream("POST", "/v1/completions", json=LONG) as waiting:
                assert waiting.status_code == 200  # admitted: it waits in the engine
                metrics = server.metrics()
                assert metrics["pdserve:num_requests_running"] == 1
                assert metrics["pdserve:num_requests_waiting"] == 1

                rejected = client.post("/v1/completions", json={"prompt": "hi"})
                assert rejected.status_code == 429
                assert int(rejected.headers["Retry-After"]) >= 1
                assert rejected.json()["error"]["type"] == "rate_limit_exceeded"

                server.process.terminate()  # SIGTERM
                rest = list(running_events)
                waiting_rest = list(events(waiting))
        assert server.stop() == 0
    finally:
        server.stop()

    # The running stream ends with a final chunk (finish_reason abort), usage, then [DONE].
    assert rest[-1] == "[DONE]"
    usage = json.loads(rest[-2])["usage"]
    last = json.loads(rest[-3])["choices"][0]
    assert last["finish_reason"] == "abort"
    assert 1 <= usage["completion_tokens"] < 1000
    # The waiting request never started; it still gets its final event.
    assert waiting_rest[-1] == "[DONE]"
    assert json.loads(waiting_rest[-3])["choices"][0]["finish_reason"] == "abort"
    assert json.loads(waiting_rest[-2])["usage"]["completion_tokens"] == 0
    log = server.log()
    assert "Traceback" not in log
    assert "status=ok finish=abort" in log


def test_the_server_freezes_its_start_up_heap_before_it_serves(monkeypatch):
    """A full collection during serving scans only what serving allocated: run_server freezes
    what start-up left alive (the engine, model, tokenizer) before uvicorn takes requests, and
    the collector, off while it starts, is on again."""
    import gc
    from types import SimpleNamespace

    from pdserve.cli import build_parser
    from pdserve.engine import llm_engine
    from pdserve.server import app, cli

    frozen_at_run = []
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config: SimpleNamespace(model_name="m"))
    monkeypatch.setattr(app, "create_app", lambda engine, settings: SimpleNamespace())

    def run(server, sockets=None):
        frozen_at_run.append((gc.get_freeze_count(), gc.isenabled()))
        server.started = True

    monkeypatch.setattr(cli.GracefulServer, "run", run)
    gc.unfreeze()
    try:
        assert cli.run_server(build_parser().parse_args(["serve", "--mode", "chunked"])) == 0
    finally:
        gc.unfreeze()
    [(num_frozen, is_collecting)] = frozen_at_run
    assert num_frozen > 0 and is_collecting
