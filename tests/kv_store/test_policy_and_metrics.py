"""The fetch-or-recompute break-even, the Prometheus exposition, and no torch import."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.kv_store import ErrorKind, FetchPolicy, KVStoreMetrics


def test_unmeasured_prefill_fetches():
    assert FetchPolicy().should_fetch(num_tokens=16, num_bytes=10**6)


# SmolLM2-135M's KV in bfloat16: 30 layers x K,V x 3 heads x 64 dims x 2 bytes.
BYTES_PER_TOKEN = 23_040


def test_break_even_on_a_fast_prefill():
    # 50k tokens/s (an accelerator) is 20 us a token; a 10 GB/s link moves one in 2.3 us,
    # so after a 2 ms round trip a hit pays from ~113 tokens on.
    policy = FetchPolicy(bandwidth=10e9, round_trip_s=0.002, prefill_tokens_per_s=50_000)
    assert not policy.should_fetch(64, 64 * BYTES_PER_TOKEN)
    assert policy.should_fetch(256, 256 * BYTES_PER_TOKEN)
    # Over a 1 GB/s link a token costs more to read than to recompute: never fetch.
    slow_link = FetchPolicy(bandwidth=1e9, round_trip_s=0.002, prefill_tokens_per_s=50_000)
    assert not any(slow_link.should_fetch(n, n * BYTES_PER_TOKEN) for n in (16, 1024, 32768))


def test_a_cpu_prefill_fetches_even_one_block():
    policy = FetchPolicy(bandwidth=1e9, round_trip_s=0.002, prefill_tokens_per_s=2_000)
    assert policy.should_fetch(16, 16 * BYTES_PER_TOKEN)  # 8 ms to recompute, 2.4 ms to read


def test_measurements_move_the_estimates():
    policy = FetchPolicy(bandwidth=1e9)
    for _ in range(50):
        policy.observe_fetch(10**8, 1.0 + policy.round_trip_s)  # a 100 MB/s link
    assert 0.9e8 < policy.bandwidth < 1.2e8
    for _ in range(50):
        policy.observe_round_trip(0.05)
    assert 0.045 < policy.round_trip_s < 0.055


def test_metrics_expose_the_documented_names():
    metrics = KVStoreMetrics("m")
    metrics.hit_tokens.inc(32)
    metrics.count_error(ErrorKind.TIMEOUT)
    metrics.fetch_latency.observe(0.003)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(metrics)  # how a server adopts them
    text = generate_latest(registry).decode()
    for name in (
        "lookup_tokens_total",
        "hit_tokens_total",
        "read_bytes_total",
        "written_bytes_total",
        "dropped_writes_total",
    ):
        assert f'pdserve:kv_store_{name}{{model_name="m"}}' in text
    assert 'pdserve:kv_store_hit_tokens_total{model_name="m"} 32.0' in text
    assert 'pdserve:kv_store_errors_total{kind="timeout",model_name="m"} 1.0' in text
    for kind in ErrorKind:  # every kind exported from the start, so rate() sees zeros
        assert f'kind="{kind.value}"' in text
    assert 'pdserve:kv_store_fetch_seconds_bucket{le="0.005",model_name="m"} 1.0' in text


def test_kv_store_does_not_import_torch():
    code = (
        "import sys; import pdserve.kv_store, pdserve.kv_store.redis_backend, "
        "pdserve.kv_store.local_backend; sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
