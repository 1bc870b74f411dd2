"""KV store read bandwidth: pdserve's read path against raw GETs of the same bytes.

A loopback `redis-server` (started here, or `--redis-url`) holds a 2,000-token prefix of
SmolLM2-135M's KV in bfloat16 (125 blocks of 16 tokens, 369 KB each). Timed, each the median
of `--repeats` runs:

- ``redis-benchmark GET``: Redis's own C client GETting one value of the same size over and
  over (`redis-benchmark -t get -c 1 -P 1`): what loopback and the server can do.
- ``redis-py GET`` / ``redis-py MGET``: the Python client (with hiredis) fetching the same
  blocks' values raw, one GET each or one MGET: the ceiling of any Python read path.
- ``read path``: `KVStore.fetch`, what a worker does: MGET, check every header, token id and
  checksum, copy each block into a KV cache.
- ``local read path``: `KVStore.fetch` on the embedded `local` store (shared memory).
- ``lookup``: `KVStore.lookup` of all 125 blocks (one pipelined round trip), in ms.

Target: the read path at >= 50% of raw GET bandwidth. On 2 vCPUs redis-server and this
process share the machine; run it alone.

    .venv/bin/python benchmarks/kv_store.py [--num-blocks 125] [--repeats 15] [--json FILE]
        [--redis-url redis://HOST:PORT/DB]

The serving half of issue 12's benchmark (two chunked servers sharing a store vs not, TTFT
and prefill tokens computed) joins once the store is wired into the engine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis

from pdserve.core.block_manager import extend_block_hashes
from pdserve.kv_store import KVStore, KVStoreConfig, LayoutFingerprint, block_refs, cache_bytes
from pdserve.kv_store.redis_server import RedisServer

# SmolLM2-135M-Instruct's cache layout (30 layers, 3 KV heads of 64) in bfloat16.
SMOLLM2 = LayoutFingerprint(
    model_id="bench-smollm2-135m",
    dtype="bfloat16",
    kv_dtype="bfloat16",
    quantization=None,
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
TARGET_RATIO = 0.5


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm: connections, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def redis_benchmark_gbps(port: int, value: bytes, num_requests: int) -> float | None:
    """Bandwidth of redis-benchmark's GET of `value`, or None without redis-benchmark."""
    key = "key:__rand_int__"  # the key redis-benchmark's GET reads (no -r)
    redis.Redis(port=port).set(key, value)
    command = ["redis-benchmark", "-p", str(port), "-t", "get", "-c", "1", "-P", "1"]
    command += ["-n", str(num_requests), "--csv", "-q"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        return None
    rps = float(re.findall(r'"GET","([0-9.]+)"', out)[-1])
    return rps * len(value) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=125)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--redis-url", help="an existing server (default: start one here)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pdserve-kvstore-bench-") as work_dir:
        server = None if args.redis_url else RedisServer(Path(work_dir))
        url = args.redis_url or server.url
        try:
            figures = measure(url, args.num_blocks, args.repeats, work_dir)
        finally:
            if server is not None:
                server.stop()
    print_report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["read_path_vs_redis_py_get"] >= TARGET_RATIO else 1


def measure(url: str, num_blocks: int, repeats: int, work_dir: str) -> dict:
    rng = np.random.default_rng(0)
    size = SMOLLM2.block_size
    token_ids = rng.integers(0, 49_152, num_blocks * size).tolist()
    blocks = block_refs(extend_block_hashes([], token_ids, size), token_ids, size, 0, num_blocks)
    # bfloat16 as its bit pattern: the store moves bytes.
    shape = (SMOLLM2.num_layers, 2, num_blocks, size, SMOLLM2.num_kv_heads, SMOLLM2.head_dim)
    source = rng.integers(0, 2**16, shape, dtype=np.uint16)
    dest = np.zeros_like(source)
    block_ids = list(range(num_blocks))

    store = KVStore(KVStoreConfig(url, timeout_s=5.0), SMOLLM2)
    local = KVStore(KVStoreConfig(f"local:{work_dir}", max_gb=1.0), SMOLLM2)
    try:
        for target in (store, local):
            assert target.write(blocks, cache_bytes(source), block_ids) == num_blocks
            assert target.flush(60.0)
        nbytes = num_blocks * store.value_nbytes
        keys = store.keys.keys(blocks)
        client = redis.Redis.from_url(url, socket_read_size=1 << 20)

        def fetch(target: KVStore) -> None:
            assert target.fetch(blocks, cache_bytes(dest), block_ids) == num_blocks

        def get_each() -> None:
            for key in keys:
                client.get(key)

        seconds = {
            "redis_py_get": median_seconds(get_each, repeats),
            "redis_py_mget": median_seconds(lambda: client.mget(keys), repeats),
            "read_path": median_seconds(lambda: fetch(store), repeats),
            "local_read_path": median_seconds(lambda: fetch(local), repeats),
            "lookup": median_seconds(lambda: store.lookup(blocks), repeats),
        }
        assert np.array_equal(source, dest)
        value = client.get(keys[0])
        client.close()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        benchmark_gbps = redis_benchmark_gbps(port, value, 20 * num_blocks)
    finally:
        store.close()
        local.close()
    gbps = {k: nbytes / v / 1e9 for k, v in seconds.items() if k != "lookup"}
    figures = {
        "num_blocks": num_blocks,
        "value_bytes": store.value_nbytes,
        "total_bytes": nbytes,
        "gbytes_per_s": {"redis_benchmark_get": benchmark_gbps, **gbps},
        "lookup_ms": seconds["lookup"] * 1e3,
        "read_path_vs_redis_py_get": gbps["read_path"] / gbps["redis_py_get"],
        "read_path_vs_redis_benchmark_get": (
            gbps["read_path"] / benchmark_gbps if benchmark_gbps else None
        ),
    }
    return figures


def print_report(figures: dict) -> None:
    print(
        f"{figures['num_blocks']} blocks x {figures['value_bytes']:,} bytes "
        f"= {figures['total_bytes'] / 1e6:.1f} MB per read"
    )
    for name, value in figures["gbytes_per_s"].items():
        shown = "n/a (no redis-benchmark)" if value is None else f"{value:6.2f} GB/s"
        print(f"  {name:<22} {shown}")
    print(f"  {'lookup (one trip)':<22} {figures['lookup_ms']:6.2f} ms")
    ratio = figures["read_path_vs_redis_py_get"]
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(f"read path / redis-py GET: {ratio:.2f} ({verdict} the {TARGET_RATIO:.0%} target)")
    c_ratio = figures["read_path_vs_redis_benchmark_get"]
    if c_ratio is not None:
        print(f"read path / redis-benchmark GET: {c_ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
