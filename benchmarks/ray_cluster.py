"""Disaggregated serving on a local 2-node Ray cluster against the one-host launcher, same cores.

Both deployments run 1 prefill + 1 decode worker of the default model, one CPU each, behind
`pdserve serve --mode disagg`, with the fleet secret on (`--worker-auth`):
- one-host: workers pinned to cores 0 and 1, KV over shared memory;
- ray: a `ray.cluster_utils.Cluster` (a head without CPUs, two 1-CPU nodes told apart by
  custom resources, a third for the restore), the pools on different Ray nodes, KV over tcp;
  Ray does not pin, so the two workers share the machine's cores as the OS schedules them.

Measured on each, in this order:
1. TTFT of a 3,000-token prompt (a fresh prompt per repeat: no prefix-cache hit; median and
   all values), and its KV transfer (bytes, ms, ms per MB, from the decode worker's
   `pdserve_timing`).
2. ITL p50/p99 of 4 concurrent streams (short prompts, --output-len tokens each, every gap
   after the first token of every stream, pooled over --repeats rounds).
3. Ray only: seconds from removing the decode worker's node to a restored pool (a healthy
   decode worker on the spare node in the router's GET /workers) and to the first answer
   after it.

Run it alone on the machine (timings are shared-core sensitive):

    .venv/bin/python benchmarks/ray_cluster.py [--repeats 3] [--output-len 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.bench.client import make_http_client, send_request
from pdserve.fleet import FLEET_SECRET_ENV
from pdserve.ports import free_port
from pdserve.workload.base import BenchRequest
from pdserve.workload.endpoint import EndpointConfig
from pdserve.workload.metrics import Distribution
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.records import RequestRecord
from pdserve.workload.tokenizer import load_tokenizer

SECRET = "benchmark-fleet-secret"
LONG_PROMPT_TOKENS = 3000
NUM_STREAMS = 4
STREAM_PROMPT_TOKENS = 64
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 78 * 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--log-dir", default=None, help="launcher and worker logs (default: new)")
    args = parser.parse_args()
    synth = PromptSynthesizer(load_tokenizer())
    results = {}
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-ray-bench-"))
    print(f"logs in {logs}", file=sys.stderr, flush=True)
    for name, deploy in (("one-host", one_host), ("ray", ray_cluster)):
        print(f"--- {name}", file=sys.stderr, flush=True)
        with deploy(logs / name) as (url, kill_decode_node):
            results[name] = measure(url, synth, args)
            if kill_decode_node is not None:
                results[name]["restore"] = measure_restore(url, kill_decode_node)
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


# ---- the two deployments --------------------------------------------------------------------


def serve(log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """`pdserve serve --mode disagg` with `flags`, healthy; (process, url)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [
        *(sys.executable, "-m", "pdserve.cli", "serve", "--mode", "disagg"),
        *("--port", str(port), "--worker-auth", "--worker-log-dir", str(log_dir / "workers")),
        *("--health-check-interval", "0.5", *flags),
    ]
    with open(log_dir / "launcher.log", "ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, FLEET_SECRET_ENV: SECRET, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while not _is_up(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = (log_dir / "launcher.log").read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError("the deployment did not start:\n" + "\n".join(tail))
        time.sleep(0.5)
    return process, url


def _stop(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def one_host(log_dir: Path) -> Iterator[tuple[str, None]]:
    process, url = serve(log_dir)
    try:
        yield url, None
    finally:
        _stop(process)


@contextlib.contextmanager
def ray_cluster(log_dir: Path) -> Iterator[tuple[str, Any]]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "num_cpus": 0, "include_dashboard": False},
    )
    process = None
    try:
        cluster.add_node(**NODE_ARGS, resources={"bench_prefill": 1})
        decode_nodes = [cluster.add_node(**NODE_ARGS, resources={"bench_decode": 1})]
        decode_nodes.append(cluster.add_node(**NODE_ARGS, resources={"bench_decode": 1}))
        process, url = serve(
            log_dir,
            *("--cluster", "ray"),
            *("--prefill-worker-resources", '{"CPU": 1, "bench_prefill": 1}'),
            *("--decode-worker-resources", '{"CPU": 1, "bench_decode": 1}'),
            env={"RAY_ADDRESS": cluster.address},
        )

        def kill_decode_node() -> str:
            """Remove the node the decode worker runs on; its Ray node id."""
            [decode] = [w for w in _workers(url) if w["role"] == "decode"]
            [node] = [n for n in decode_nodes if n.node_id == decode["node_id"]]
            cluster.remove_node(node)
            return node.node_id

        yield url, kill_decode_node
    finally:
        if process is not None:
            _stop(process)
        cluster.shutdown()


# ---- measurements ---------------------------------------------------------------------------


def measure(url: str, synth: PromptSynthesizer, args: argparse.Namespace) -> dict[str, Any]:
    config = EndpointConfig(base_url=url)
    rng = np.random.default_rng(0)
    asyncio.run(_stream_all(config, [BenchRequest(synth.text(64, rng), 64, 8)]))  # warm up
    long_runs = []
    for _ in range(args.repeats):
        request = BenchRequest(synth.text(LONG_PROMPT_TOKENS, rng), LONG_PROMPT_TOKENS, 8)
        [record] = asyncio.run(_stream_all(config, [request]))
        timing = record.server_extra.get("pdserve_timing", {})
        long_runs.append(
            {
                "ttft_ms": record.ttft * 1e3,
                "kv_bytes": timing.get("kv_transfer_bytes"),
                "kv_ms": timing.get("kv_transfer_ms"),
            }
        )
    gaps = []
    for _ in range(args.repeats):
        requests = [
            BenchRequest(
                synth.text(STREAM_PROMPT_TOKENS, rng), STREAM_PROMPT_TOKENS, args.output_len
            )
            for _ in range(NUM_STREAMS)
        ]
        for record in asyncio.run(_stream_all(config, requests)):
            gaps.extend(record.itls)
    itl = Distribution.of_seconds(gaps)
    kv_mb = [r["kv_bytes"] / 1e6 for r in long_runs if r["kv_bytes"]]
    kv_ms = [r["kv_ms"] for r in long_runs if r["kv_bytes"]]
    return {
        "ttft_3000_ms": statistics.median(r["ttft_ms"] for r in long_runs),
        "ttft_3000_runs_ms": [round(r["ttft_ms"], 1) for r in long_runs],
        "kv_transfer_mb": statistics.median(kv_mb) if kv_mb else None,
        "kv_transfer_ms": statistics.median(kv_ms) if kv_ms else None,
        "kv_ms_per_mb": statistics.median(ms / mb for ms, mb in zip(kv_ms, kv_mb, strict=True))
        if kv_mb
        else None,
        "itl_p50_ms": itl.median,
        "itl_p99_ms": itl.p99,
        "num_itl_samples": len(gaps),
    }


async def _stream_all(config: EndpointConfig, requests: list[BenchRequest]) -> list[RequestRecord]:
    """Send `requests` at once; their records (any failure raises)."""
    records = [
        RequestRecord(i, "bench", r.prompt_len, r.output_len, 0.0) for i, r in enumerate(requests)
    ]
    t0 = time.perf_counter()
    async with make_http_client(config) as http:
        model = (await http.get(config.url("/v1/models"))).json()["data"][0]["id"]
        await asyncio.gather(
            *(
                send_request(http, config, model, r, rec, t0)
                for r, rec in zip(requests, records, strict=True)
            )
        )
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"requests failed: {failed}")
    return records


def measure_restore(url: str, kill_decode_node) -> dict[str, float]:
    """Seconds from a decode node's death to a restored decode pool and to the next answer."""
    started = time.monotonic()
    dead = kill_decode_node()
    while not any(
        w["role"] == "decode" and w["state"] == "healthy" and w["node_id"] != dead
        for w in _workers(url)
    ):
        time.sleep(0.1)
    restored = time.monotonic()
    body = {"prompt": "After the node died,", "max_tokens": 4}
    response = httpx.post(f"{url}/v1/completions", json=body, trust_env=False, timeout=600)
    response.raise_for_status()
    return {
        "node_death_to_restored_pool_s": restored - started,
        "node_death_to_next_answer_s": time.monotonic() - started,
    }


def render(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("TTFT, 3,000-token prompt (median ms)", "ttft_3000_ms"),
        ("ITL p50, 4 streams (ms)", "itl_p50_ms"),
        ("ITL p99, 4 streams (ms)", "itl_p99_ms"),
        ("KV transfer of that prompt (MB)", "kv_transfer_mb"),
        ("KV transfer (ms)", "kv_transfer_ms"),
        ("KV transfer (ms per MB)", "kv_ms_per_mb"),
    ]
    names = list(results)
    lines = [f"| | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for label, key in rows:
        cells = [_cell(results[name].get(key)) for name in names]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    for name, result in results.items():
        for key, value in result.get("restore", {}).items():
            lines.append(f"| {key.replace('_', ' ')} ({name}) | {value:.1f} |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _workers(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/workers", trust_env=False, timeout=30).json()["workers"]


def _is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", trust_env=False, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
