"""Real `pdserve serve` processes sharing a KV store (issue 12's end-to-end checks): a ~1,500-
token prefix is computed once across servers and restarts, greedy output is unchanged, and a
killed, restarted or corrupted store costs only recomputation. No test leaks a KV block."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench.processes import child_pids
from pdserve.core.block_manager import extend_block_hashes
from pdserve.kv_store import KVStoreConfig
from pdserve.kv_store.codec import value_nbytes
from pdserve.model.loader import default_model_path, open_checkpoint
from pdserve.ports import free_port_block
from tests.kv_store.conftest import REDIS_SERVER, RedisServer
from tests.router.harness import wait_until
from tests.server.conftest import NUM_KV_BLOCKS, ServerProcess, start_server

pytestmark = pytest.mark.slow
DASHBOARD = Path(__file__).parents[2] / "grafana" / "pdserve-dashboard.json"
BLOCK_SIZE = 16
PREFIX_TEXT = (
    "You are the support assistant of a company that sells bicycles, spare parts and repairs. "
    "Answer briefly and politely, name the part number when you know it. "
) * 48


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.model.gguf_file import GGUFModelFile
    from pdserve.model.loader import default_model_path

    return GGUFModelFile(default_model_path()).tokenizer()


@pytest.fixture(scope="module")
def prefix(tokenizer) -> list[int]:
    ids = tokenizer.encode(PREFIX_TEXT)
    assert 1300 <= len(ids) <= 1700
    return ids


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A server without a store: the outputs every store run must reproduce."""
    server = start_server(tmp_path_factory.mktemp("reference"))
    yield server
    server.stop()


def _complete(server, prompt: list[int]) -> list[int]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12}
    # router_timing (as the router sends it) asks for the pdserve_timing breakdown.
    body |= {"temperature": 0.0, "router_timing": {}}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def _tokens(response) -> str:
    return response["choices"][0]["text"]


def _question(tokenizer, prefix, text: str) -> list[int]:
    return prefix + tokenizer.encode(f" Customer: {text}\nAssistant:")


def _metric(server, name: str, **labels) -> float:
    key = name + (
        "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""
    )
    return server.metrics().get(key, 0.0)


def _wait_until_stored(writer, num_tokens: int) -> None:
    """Wait until `writer` (float32, start_server's dtype) has stored the blocks of a prompt's
    first `num_tokens` tokens. Its writes are behind its answers; a reader that comes sooner
    waits for blocks in flight only up to a bound, which a loaded machine can outlast."""
    config = open_checkpoint(default_model_path()).config
    values = config.num_hidden_layers * 2 * BLOCK_SIZE * config.num_key_value_heads
    block_nbytes = value_nbytes(BLOCK_SIZE, values * config.head_dim * 4)  # float32
    wait_until(
        lambda: (
            _metric(writer, "pdserve:kv_store_written_bytes_total")
            >= num_tokens // BLOCK_SIZE * block_nbytes
        ),
        timeout=60,
        what=f"{num_tokens // BLOCK_SIZE} blocks stored",
    )


def _assert_no_leaks(*servers) -> None:
    for server in servers:
        wait_until(
            lambda s=server: _metric(s, "pdserve:kv_cache_free_blocks") == NUM_KV_BLOCKS,
            timeout=30,
            what="every KV block free",
        )


def _assert_dashboard_shows_store_metrics(server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    shown = {n for e in exprs for n in re.findall(r"pdserve:kv_store_[a-z0-9_]+", e)}
    exported = {k.split("{")[0] for k in server.metrics() if k.startswith("pdserve:kv_store_")}
    assert shown <= exported, shown - exported
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exported}
    assert families <= {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in shown}


def _serve(tmp_path, url: str, *args: str):
    return start_server(tmp_path, "--kv-store", url, *args)


def test_two_servers_share_a_prefix_through_redis(
    tmp_path, redis_server, tokenizer, prefix, reference
):
    first = _serve(tmp_path, redis_server.url)
    second = _serve(tmp_path, redis_server.url)
    try:
        prompt = _question(tokenizer, prefix, "How much is a new chain?")
        _complete(first, prompt)
        # At once: the blocks still in the first server's write-behind queue are announced in
        # flight, and the second server reads them as they land instead of computing them.
        answer = _complete(second, prompt)
        num_readable = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # one token is computed
        assert _metric(second, "pdserve:kv_store_hit_tokens_total") == num_readable
        timing = answer["pdserve_timing"]
        assert timing["kv_store_hit_tokens"] == num_readable and timing["kv_store_fetch_ms"] > 0
        # Only the tail (under a block, and the last token) is computed.
        usage = answer["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["prompt_tokens_details"]["cached_tokens"] == num_readable
        assert _tokens(answer) == _tokens(_complete(reference, prompt))
        _assert_dashboard_shows_store_metrics(second)
        # A write announced but never landing (its writer killed after announcing: the
        # markers it leaves) costs the reader the bound, then the prompt is computed.
        raw = redis_server.client()
        stored = next(k for k in raw.scan_iter(match="pdserve:kv:*") if b":pending" not in k)
        key_prefix = stored.rsplit(b":", 1)[0]
        lost = tokenizer.encode("Write me a poem about the sea and its lighthouses. " * 20)
        for block_hash in extend_block_hashes([], lost, BLOCK_SIZE):
            raw.set(key_prefix + f":{block_hash:016x}:pending".encode(), b"", px=60_000)
        answer = _complete(second, lost)
        timing = answer["pdserve_timing"]
        assert timing["kv_store_hit_tokens"] == 0
        assert timing["kv_store_fetch_ms"] >= 1000 * KVStoreConfig.pending_write_wait_s
        assert _tokens(answer) == _tokens(_complete(reference, lost))
        _assert_no_leaks(first, second)
        # A restarted server starts with an empty cache but finds the prefix in the store.
        first.stop()
        restarted = _serve(tmp_path, redis_server.url)
        try:
            third = _question(tokenizer, prefix, "Are you open on Sundays?")
            answer = _complete(restarted, third)
            num_full_blocks = len(prefix) // BLOCK_SIZE * BLOCK_SIZE
            assert answer["pdserve_timing"]["kv_store_hit_tokens"] >= num_full_blocks
            assert _tokens(answer) == _tokens(_complete(reference, third))
            _assert_no_leaks(restarted)
        finally:
            restarted.stop()
    finally:
        first.stop()
        second.stop()


def test_store_faults_cost_only_recomputation(tmp_path, redis_server, tokenizer, prefix, reference):
    server = _serve(tmp_path, redis_server.url)
    try:
        # Killed: requests complete by recomputing, /health stays 200, errors are counted.
        redis_server.kill()
        prompt = _question(tokenizer, prefix, "Do you sell helmets?")
        answer = _complete(server, prompt)
        assert _tokens(answer) == _tokens(_complete(reference, prompt))
        assert answer["pdserve_timing"]["kv_store_hit_tokens"] == 0
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert _metric(server, "pdserve:kv_store_errors_total", kind="connection") >= 1
        # Restarted (empty): once its backoff passes the server reconnects and writes again.
        redis_server.start()
        for attempt in range(30):
            _complete(server, _question(tokenizer, prefix[:400], f"Hello {attempt}?"))
            if _metric(server, "pdserve:kv_store_written_bytes_total") > 0:
                break
            time.sleep(0.5)
        assert _metric(server, "pdserve:kv_store_written_bytes_total") > 0
        # A value overwritten with garbage is a counted miss; the output stays right.
        raw = redis_server.client()
        for key in raw.scan_iter(match="pdserve:kv:*"):
            raw.set(key, b"garbage" * 100)
        prompt = _question(tokenizer, prefix[:400], "Which tyres fit a road bike?")
        fresh = _serve(tmp_path, redis_server.url)  # no local cache: it must read the store
        try:
            answer = _complete(fresh, prompt)
            assert _tokens(answer) == _tokens(_complete(reference, prompt))
            assert _metric(fresh, "pdserve:kv_store_errors_total", kind="corrupt") >= 1
            _assert_no_leaks(server, fresh)
        finally:
            fresh.stop()
    finally:
        server.stop()


def test_another_dtype_never_reads_these_blocks(tmp_path, redis_server, tokenizer, prefix):
    prompt = _question(tokenizer, prefix[:400], "What is a derailleur?")
    writer = _serve(tmp_path, redis_server.url)
    try:
        _complete(writer, prompt)
        wait_until(lambda: _metric(writer, "pdserve:kv_store_written_bytes_total") > 0, timeout=30)
    finally:
        writer.stop()
    # start_server passes float32; a later --dtype wins.
    other = _serve(tmp_path, redis_server.url, "--dtype", "bfloat16")
    reference_bf16 = start_server(tmp_path, "--dtype", "bfloat16")
    try:
        answer = _complete(other, prompt)
        assert answer["pdserve_timing"]["kv_store_hit_tokens"] == 0
        assert _tokens(answer) == _tokens(_complete(reference_bf16, prompt))
        _assert_no_leaks(other)
    finally:
        other.stop()
        reference_bf16.stop()


def test_local_store_is_shared_by_two_processes(tmp_path, tokenizer, prefix, reference):
    url = f"local:{tmp_path}"
    first = _serve(tmp_path, url, "--kv-store-max-gb", "0.5")
    second = _serve(tmp_path, url, "--kv-store-max-gb", "0.5")
    try:
        _complete(first, _question(tokenizer, prefix, "Do you deliver?"))
        prompt = _question(tokenizer, prefix, "Can I return a saddle?")
        _wait_until_stored(first, len(prefix))
        answer = _complete(second, prompt)
        assert (
            answer["pdserve_timing"]["kv_store_hit_tokens"]
            >= len(prefix) // BLOCK_SIZE * BLOCK_SIZE
        )
        assert _tokens(answer) == _tokens(_complete(reference, prompt))
        _assert_no_leaks(first, second)
    finally:
        first.stop()
        second.stop()


def test_disaggregated_prefill_writes_and_the_decode_worker_reads(
    tmp_path, tokenizer, prefix, reference
):
    # A password-protected store: the launcher reads the password from a file and hands it to
    # its workers in their environment; no process's argv shows it.
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (make install-test installs it)")
    password = "store-password-never-in-argv"
    redis_server = RedisServer(tmp_path, "--requirepass", password)
    (tmp_path / "redis-password").write_text(password + "\n")
    base = free_port_block(2)  # prefill worker on base, decode worker on base + 1
    deployment = start_server(
        tmp_path, "--mode", "disagg", "--kv-store", redis_server.url,
        "--kv-store-password-file", str(tmp_path / "redis-password"),
        "--worker-base-port", str(base),
    )  # fmt: skip
    try:
        workers = child_pids(deployment.process.pid)
        assert len(workers) >= 2
        for pid in (deployment.process.pid, *workers):
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        prefill = ServerProcess(None, f"http://127.0.0.1:{base}", tmp_path, None)
        decode = ServerProcess(None, f"http://127.0.0.1:{base + 1}", tmp_path, None)
        # The prefill worker computes a prompt and writes its blocks...
        _complete(prefill, _question(tokenizer, prefix, "Do you rent bikes?"))
        _wait_until_stored(prefill, len(prefix))
        # ...which the decode worker, prefilling a short-suffixed prompt itself, reads.
        prompt = _question(tokenizer, prefix, "What does a service cost?")
        answer = _complete(decode, prompt)
        assert answer["pdserve_timing"]["kv_store_hit_tokens"] >= len(prefix) // 16 * 16
        assert _tokens(answer) == _tokens(_complete(reference, prompt))
        # Through the router (prefill leg, KV transfer, decode leg) the output is unchanged.
        routed = _question(tokenizer, prefix, "Can I pay by card?")
        assert _tokens(_complete(deployment, routed)) == _tokens(_complete(reference, routed))
        _assert_no_leaks(prefill, decode)
    finally:
        deployment.stop()
        redis_server.stop()
