"""Server overhead: what the HTTP/SSE layer adds on top of the engine.

1. Single stream: inter-token latency measured by the client minus the engine's own step time
   (from `pdserve:engine_step_time_seconds` in /metrics, over the same request). Target: < 2 ms.
2. Throughput of the HTTP layer: requests/s with max_tokens=1 and a tiny prompt, from several
   concurrent clients.

Starts `pdserve serve` itself (or use --url for a running server):

    .venv/bin/python benchmarks/server_overhead.py                   # default model
    .venv/bin/python benchmarks/server_overhead.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.ports import free_port

STEP_METRIC = "pdserve:engine_step_time_seconds"


def main() -> int:
    args = parse_args()
    server = None if args.url else start_server(args)
    url = args.url or server[1]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            single_stream(client, model, args.max_tokens)  # warm-up
            itl = single_stream(client, model, args.max_tokens)
        rps = asyncio.run(throughput(url, headers, model, args.concurrency, args.duration))
    finally:
        if server is not None:
            server[0].send_signal(signal.SIGTERM)
            server[0].wait(60)
    report = {"single_stream": itl, "throughput": rps}
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running pdserve server (default: start one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="tokens of the single measured stream"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds of the max_tokens=1 throughput run"
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after --: extra `pdserve serve` flags (e.g. -- --dtype bfloat16)",
    )
    return parser.parse_args()


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    extra = [a for a in args.server_args if a != "--"]
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--port",
        str(port),
        "--max-queue",
        "4096",
        *extra,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}: {' '.join(command)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # waiting for a starting process
    process.kill()
    raise SystemExit("server did not become healthy in 300 s")


def step_histogram(client: httpx.Client) -> tuple[float, float]:
    """(sum, count) of the engine step-time histogram."""
    total = count = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == STEP_METRIC:
            for sample in family.samples:
                if sample.name == STEP_METRIC + "_sum":
                    total += sample.value
                elif sample.name == STEP_METRIC + "_count":
                    count += sample.value
    return total, count


def single_stream(client: httpx.Client, model: str, max_tokens: int) -> dict:
    """One streamed completion; client ITL vs engine step time over the same steps."""
    body = {
        "model": model,
        "prompt": "Hi",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    steps_before = step_histogram(client)
    arrivals: list[float] = []
    num_tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    steps_after = step_histogram(client)
    step_sum = steps_after[0] - steps_before[0]
    step_count = steps_after[1] - steps_before[1]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Chunks can carry several tokens (held-back text), so the mean is per token.
    itl_mean = (arrivals[-1] - arrivals[0]) / max(num_tokens - 1, 1)
    step_mean = step_sum / step_count
    return {
        "num_tokens": num_tokens,
        "num_chunks": len(arrivals),
        "num_steps": int(step_count),
        "client_itl_mean_ms": itl_mean * 1e3,
        "client_itl_p50_ms": statistics.median(gaps) * 1e3,
        "client_itl_p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3,
        "engine_step_mean_ms": step_mean * 1e3,
        "overhead_per_token_ms": (itl_mean - step_mean) * 1e3,
    }


async def throughput(
    url: str, headers: dict, model: str, concurrency: int, duration: float
) -> dict:
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    deadline = time.perf_counter() + duration

    async def worker(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            response = await client.post("/v1/completions", json=body)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code == 200:
                latencies.append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=300, limits=limits
    ) as client:
        await client.post("/v1/completions", json=body)  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "concurrency": concurrency,
        "seconds": elapsed,
        "num_ok": len(latencies),
        "statuses": statuses,
        "requests_per_s": len(latencies) / elapsed,
        "latency_p50_ms": latencies[len(latencies) // 2] * 1e3 if latencies else None,
        "latency_p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3 if latencies else None,
    }


def print_report(report: dict) -> None:
    s, t = report["single_stream"], report["throughput"]
    print(
        f"single stream: {s['num_tokens']} tokens in {s['num_chunks']} chunks, "
        f"{s['num_steps']} engine steps"
    )
    print(
        f"  client ITL mean {s['client_itl_mean_ms']:.2f} ms "
        f"(p50 {s['client_itl_p50_ms']:.2f}, p99 {s['client_itl_p99_ms']:.2f})"
    )
    print(f"  engine step mean {s['engine_step_mean_ms']:.2f} ms")
    verdict = "OK" if s["overhead_per_token_ms"] < 2.0 else "ABOVE TARGET"
    print(
        f"  server overhead per token {s['overhead_per_token_ms']:.2f} ms "
        f"(target < 2 ms: {verdict})"
    )
    print(
        f"max_tokens=1 throughput: {t['requests_per_s']:.1f} requests/s with "
        f"{t['concurrency']} clients over {t['seconds']:.1f} s (statuses {t['statuses']}; "
        f"latency p50 {t['latency_p50_ms']:.1f} ms, p99 {t['latency_p99_ms']:.1f} ms)"
    )


if __name__ == "__main__":
    sys.exit(main())
