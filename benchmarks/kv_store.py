"""The shared KV store: serving with and without it, and its read path against raw GETs.

Serving (issue 12's workload): two chunked servers on this host, round-robin, 64 requests
over 8 system prompts of 2,000 tokens, each with its own 32-token question (request k uses
prompt (k // 2) % 8 on server k % 2, so each prompt's first visit to the second server
follows its first on the first), once with both servers on one Redis store and once without.
Per run: TTFT p50/p99 (non-streaming, max_tokens 1), prompt tokens computed (prompt minus
cached, which counts store hits) and the store's hit rate. Targets: the second server's first
hits at <= 0.2x the TTFT of the same requests cold (the no-store run), and the store run's
prompt tokens computed <= 0.55x the no-store run's and within 5% of the ideal (each system
prompt computed once in the fleet, every later request computing only what no full block
holds, and its last token).

Read path: a loopback `redis-server` (started here, or `--redis-url`) holds a 2,000-token prefix of
SmolLM2-135M's KV in bfloat16 (125 blocks of 16 tokens, 369 KB each). Timed, each the median
of `--repeats` runs:

- ``redis-benchmark GET``: Redis's own C client GETting one value of the same size over and
  over (`redis-benchmark -t get -c 1 -P 1`): what loopback and the server can do.
- ``redis-py GET`` / ``redis-py MGET``: the Python client (with hiredis) fetching the same
  blocks' values raw, one GET each or one MGET.
- ``read path``: `KVStore.fetch`, what a worker does: pipelined GETs received straight into a
  KV cache's blocks, every header, token id and checksum checked there.
- ``local read path``: `KVStore.fetch` on the embedded `local` store (shared memory).
- ``lookup``: `KVStore.lookup` of all 125 blocks (one pipelined round trip), in ms.

Target: the read path at >= 50% of raw GET bandwidth. On 2 vCPUs redis-server and this
process share the machine; run it alone.

    .venv/bin/python benchmarks/kv_store.py [--part all|serving|read] [--json FILE]
        [--num-blocks 125] [--repeats 15] [--redis-url redis://HOST:PORT/DB]
        [--server-args '--dtype bfloat16']
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import redis
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from pdserve.bench.launcher import LaunchConfig, launch_server
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


def redis_benchmark_gbps(url: str, value: bytes, num_requests: int) -> float | None:
    """Bandwidth of redis-benchmark's GET of `value` from the server at `url`, or None
    without redis-benchmark."""
    key = "key:__rand_int__"  # the key redis-benchmark's GET reads (no -r)
    client = redis.Redis.from_url(url)
    client.set(key, value)
    where = client.connection_pool.connection_kwargs
    client.close()
    if "path" in where:
        command = ["redis-benchmark", "-s", where["path"]]
    else:
        command = ["redis-benchmark", "-h", where["host"], "-p", str(where["port"])]
    if where.get("username"):
        command += ["--user", where["username"]]
    if where.get("password"):
        command += ["-a", where["password"]]
    command += ["--dbnum", str(where.get("db", 0)), "-t", "get", "-c", "1", "-P", "1"]
    command += ["-n", str(num_requests), "--csv", "-q"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        return None
    rps = float(re.findall(r'"GET","([0-9.]+)"', out)[-1])
    return rps * len(value) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "serving", "read"), default="all")
    parser.add_argument("--num-blocks", type=int, default=125)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--redis-url", help="an existing server (default: start one here)")
    parser.add_argument("--server-args", default="", help="extra `pdserve serve` flags")
    parser.add_argument("--num-prompts", type=int, default=8, help="system prompts")
    parser.add_argument("--prompt-len", type=int, default=2000, help="tokens per system prompt")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-kvstore-bench-") as work_dir:
        server = None if args.redis_url else RedisServer(Path(work_dir))
        url = args.redis_url or server.url
        try:
            if args.part in ("all", "serving"):
                workload = Workload(args.num_prompts, args.prompt_len, args.num_requests)
                figures["serving"] = measure_serving(
                    url, Path(work_dir), args.server_args, workload
                )
                print_serving(figures["serving"])
            if args.part in ("all", "read"):
                figures["read"] = measure(url, args.num_blocks, args.repeats, work_dir)
                print_report(figures["read"])
        finally:
            if server is not None:
                server.stop()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if all(part["meets_targets"] for part in figures.values()) else 1


# ---- serving ---------------------------------------------------------------------------
QUESTION_LEN = 32
SERVING_TTFT_TARGET, SERVING_COMPUTE_TARGET, SERVING_IDEAL_TARGET = 0.2, 0.55, 1.05
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    prompt_len: int
    num_requests: int

    def requests(self) -> list[tuple[int, int, list[int]]]:
        """(server index, system prompt index, token ids) per request, in order."""
        rng = np.random.default_rng(12)
        # Ordinary vocabulary ids (SmolLM2's special tokens sit below 20).
        prompts = [
            rng.integers(1000, 40_000, self.prompt_len).tolist() for _ in range(self.num_prompts)
        ]
        requests = []
        for k in range(self.num_requests):
            p = (k // 2) % self.num_prompts
            question = rng.integers(1000, 40_000, QUESTION_LEN).tolist()
            requests.append((k % 2, p, prompts[p] + question))
        return requests


def run_serving(servers: list[str], requests) -> list[dict]:
    results = []
    with httpx.Client(timeout=600, trust_env=False) as client:
        model = client.get(f"{servers[0]}/v1/models").json()["data"][0]["id"]
        for server, prompt_index, prompt in tqdm(requests, desc="requests", leave=False):
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            response = client.post(f"{servers[server]}/v1/completions", json=body)
            ttft = time.perf_counter() - start
            response.raise_for_status()
            usage = response.json()["usage"]
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            results.append(
                {
                    "server": server,
                    "prompt": prompt_index,
                    "ttft_s": ttft,
                    "computed": usage["prompt_tokens"] - cached,
                }
            )
    return results


def store_counters(servers: list[str]) -> dict[str, float]:
    totals = {"lookup": 0.0, "hit": 0.0}
    for url in servers:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            for sample in family.samples:
                for key in totals:
                    if sample.name == f"pdserve:kv_store_{key}_tokens_total":
                        totals[key] += sample.value
    return totals


def measure_serving(url: str, work_dir: Path, server_args: str, workload: Workload) -> dict:
    requests = workload.requests()
    runs = {}
    for run, store_args in (("no_store", ()), ("store", ("--kv-store", url))):
        namespace = ("--kv-store-namespace", f"bench-{time.time_ns()}") if store_args else ()
        extra = ("--device", "cpu", "--num-threads", "1", *store_args, *namespace)
        extra += tuple(shlex.split(server_args))
        with contextlib.ExitStack() as stack:
            servers = [
                stack.enter_context(
                    launch_server(
                        LaunchConfig(extra_args=extra, log_dir=work_dir / f"{run}-{i}"), "chunked"
                    )
                ).base_url
                for i in range(2)
            ]
            # Warm each server (first-step allocations) on a prompt unlike the workload's.
            run_serving(servers, [(i, -1, [1000 + i] * 64) for i in range(2)])
            results = run_serving(servers, requests)
            runs[run] = {"results": results, **store_counters(servers)}
    return serving_figures(runs, workload)


def serving_figures(runs: dict, workload: Workload) -> dict:
    def ttfts(results, keep=lambda r: True):
        return [r["ttft_s"] for r in results if keep(r)]

    # Request k = 2p + 1 is prompt p's first visit to the second server.
    firsts = {2 * p + 1 for p in range(workload.num_prompts)}
    figures = {
        "num_requests": workload.num_requests,
        "prompt_tokens": workload.prompt_len + QUESTION_LEN,
    }
    for run, data in runs.items():
        results = data["results"]
        all_ttft = ttfts(results)
        figures[run] = {
            "ttft_p50_s": statistics.median(all_ttft),
            "ttft_p99_s": float(np.percentile(all_ttft, 99)),
            "second_server_first_ttft_p50_s": statistics.median(
                [results[k]["ttft_s"] for k in sorted(firsts)]
            ),
            "prompt_tokens_computed": sum(r["computed"] for r in results),
            "store_hit_rate": data["hit"] / data["lookup"] if data["lookup"] else None,
        }
    store, cold = figures["store"], figures["no_store"]
    figures["first_hit_ttft_vs_cold"] = (
        store["second_server_first_ttft_p50_s"] / cold["second_server_first_ttft_p50_s"]
    )
    figures["computed_vs_no_store"] = (
        store["prompt_tokens_computed"] / cold["prompt_tokens_computed"]
    )
    figures["ideal_prompt_tokens_computed"] = ideal_computed(workload)
    figures["computed_vs_ideal"] = (
        store["prompt_tokens_computed"] / figures["ideal_prompt_tokens_computed"]
    )
    figures["meets_targets"] = (
        figures["first_hit_ttft_vs_cold"] <= SERVING_TTFT_TARGET
        and figures["computed_vs_no_store"] <= SERVING_COMPUTE_TARGET
        and figures["computed_vs_ideal"] <= SERVING_IDEAL_TARGET
    )
    return figures


def ideal_computed(workload: Workload) -> int:
    """Prompt tokens a perfect fleet-wide cache computes: a system prompt's first request all
    of its prompt, every later one what is past its cached full blocks (at least one token)."""
    seen: set[int] = set()
    total = 0
    for _, prompt_index, prompt in workload.requests():
        if prompt_index in seen:
            cached = min(workload.prompt_len, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
            total += len(prompt) - cached
        else:
            seen.add(prompt_index)
            total += len(prompt)
    return total


def print_serving(figures: dict) -> None:
    print(f"serving: {figures['num_requests']} requests of {figures['prompt_tokens']} tokens")
    for run in ("no_store", "store"):
        f = figures[run]
        rate = "-" if f["store_hit_rate"] is None else f"{f['store_hit_rate']:.2f}"
        print(
            f"  {run:<9} TTFT p50 {f['ttft_p50_s'] * 1e3:7.1f} ms  p99 "
            f"{f['ttft_p99_s'] * 1e3:7.1f} ms  second server's first visit p50 "
            f"{f['second_server_first_ttft_p50_s'] * 1e3:7.1f} ms  prompt tokens computed "
            f"{f['prompt_tokens_computed']:,}  store hit rate {rate}"
        )
    print(
        f"  first hit / cold TTFT: {figures['first_hit_ttft_vs_cold']:.2f} "
        f"(target <= {SERVING_TTFT_TARGET}); computed store / no store: "
        f"{figures['computed_vs_no_store']:.2f} (target <= {SERVING_COMPUTE_TARGET}); "
        f"computed / ideal ({figures['ideal_prompt_tokens_computed']:,}): "
        f"{figures['computed_vs_ideal']:.3f} (target <= {SERVING_IDEAL_TARGET})"
    )


# ---- read path -------------------------------------------------------------------------
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
        benchmark_gbps = redis_benchmark_gbps(url, value, 20 * num_blocks)
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
    # The target is against raw GETs (redis-benchmark's C client); redis-py's where it is
    # not installed.
    figures["target_baseline"] = "redis_benchmark_get" if benchmark_gbps else "redis_py_get"
    figures["meets_targets"] = figures[f"read_path_vs_{figures['target_baseline']}"] >= TARGET_RATIO
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
    baselines = {"redis_benchmark_get": "redis-benchmark GET", "redis_py_get": "redis-py GET"}
    for baseline, name in baselines.items():
        ratio = figures[f"read_path_vs_{baseline}"]
        if ratio is None:
            continue
        verdict = ""
        if baseline == figures["target_baseline"]:
            met = "meets" if ratio >= TARGET_RATIO else "misses"
            verdict = f" ({met} the {TARGET_RATIO:.0%} target)"
        print(f"read path / {name}: {ratio:.2f}{verdict}")


if __name__ == "__main__":
    sys.exit(main())
