"""The router's predicted hit tokens against the workers' real ones, under churn.

Two real decode workers (each prefills its own requests) with KV caches small enough that
blocks are evicted, behind two real `pdserve router`s (prefix_aware) that follow the workers'
KV events. Requests are token-id prompts, a system prompt of `--topic-tokens` (one of
`--num-topics`, drawn with Zipf-like weights) and a fresh question, sent one at a time through
the two routers in turn; at `--restart-at` of the run one worker is killed and started again
on its port (an empty cache, a new event epoch). Per request the router's
``x-pdserve-timing`` header gives its predicted hit tokens (from the events) and the serving
worker's real ones (``pdserve_timing``), its TTFT and the worker it chose.

The removed belief (a router's own record of the prompts it routed, blind to evictions,
restarts and the other router) is replayed over the same requests and routing decisions, so
its prediction error is measured on the same run; what it would have routed differently (its
TTFT and tokens computed) is not, since no router builds it any more.

Figures: sum |predicted - real| / sum real over the run (goal: within 2% for the events), for
the events and the belief; TTFT p50/p99; prompt tokens computed.

    .venv/bin/python benchmarks/routing_churn.py [--num-requests 120] [--num-topics 12]
        [--topic-tokens 192] [--num-kv-blocks 64] [--restart-at 0.5] [--max-seconds 300]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from pdserve.core.block_manager import extend_block_hashes
from pdserve.ports import free_port

BLOCK_SIZE = 16
QUESTION_TOKENS = 24
TARGET_ERROR = 0.02
WORKER_FLAGS = ("--role", "decode", "--kv-transport", "tcp", "--device", "cpu")
WORKER_FLAGS += ("--dtype", "float32", "--max-num-seqs", "4", "--num-threads", "1")


class _Process:
    """A `pdserve` command on a loopback port, its output in `log_dir`."""

    def __init__(self, log_dir: Path, name: str, port: int, *argv: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        command = [sys.executable, "-m", "pdserve.cli", *argv, "--port", str(port)]
        with open(log_dir / f"{name}.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).is_success:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not healthy in {timeout_s} s")

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


def _worker(log_dir: Path, name: str, port: int, num_kv_blocks: int) -> _Process:
    flags = (*WORKER_FLAGS, "--num-kv-blocks", str(num_kv_blocks))
    return _Process(log_dir, name, port, "serve", *flags)


@contextlib.contextmanager
def fleet(log_dir: Path, num_kv_blocks: int) -> Iterator[tuple[list[_Process], list[_Process]]]:
    """Two workers and two routers; whatever the lists hold at the end is stopped (a worker
    restarted in between included)."""
    workers: list[_Process] = []
    routers: list[_Process] = []
    try:
        workers += [_worker(log_dir, f"w{i}", free_port(), num_kv_blocks) for i in range(2)]
        for worker in workers:
            worker.wait_healthy()
        router_flags = ("--decode", *(w.url for w in workers), "--decode-policy", "prefix_aware")
        router_flags += ("--local-prefill-threshold", str(1 << 20))
        router_flags += ("--health-check-interval", "0.2")
        routers += [
            _Process(log_dir, f"r{i}", free_port(), "router", *router_flags) for i in range(2)
        ]
        for router in routers:
            router.wait_healthy()
        yield workers, routers
    finally:
        for process in workers + routers:
            process.stop()


def workload(args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(topic, token ids) per request."""
    rng = np.random.default_rng(7)
    topics = [
        rng.integers(1000, 40_000, args.topic_tokens).tolist() for _ in range(args.num_topics)
    ]
    weights = 1.0 / np.arange(1, args.num_topics + 1)
    picks = rng.choice(args.num_topics, args.num_requests, p=weights / weights.sum())
    return [
        (int(t), topics[t] + rng.integers(1000, 40_000, QUESTION_TOKENS).tolist()) for t in picks
    ]


def run(args: argparse.Namespace, log_dir: Path) -> list[dict]:
    requests = workload(args)
    restart_at = int(args.restart_at * len(requests))
    deadline = time.monotonic() + args.max_seconds
    records = []
    with (
        fleet(log_dir, args.num_kv_blocks) as (workers, routers),
        httpx.Client(timeout=300, trust_env=False) as client,
    ):
        for k, (topic, prompt) in enumerate(requests):
            if time.monotonic() > deadline:
                break
            if k == restart_at:
                old = workers[1]
                old.stop(kill=True)
                workers[1] = _worker(log_dir, "w1-restarted", old.port, args.num_kv_blocks)
                workers[1].wait_healthy()
            router = k % 2
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            response = client.post(f"{routers[router].url}/v1/completions", json=body)
            response.raise_for_status()
            timing = json.loads(response.headers["x-pdserve-timing"])
            records.append(
                {
                    "router": router,
                    "topic": topic,
                    "prompt": prompt,
                    "worker": timing["decode_worker"],
                    "predicted": timing.get("predicted_hit_tokens", 0),
                    "real": timing["hit_tokens"],
                    "ttft_s": timing["ttft_ms"] / 1e3,
                    "restarted_before": k >= restart_at,
                }
            )
    return records


def belief_predictions(records: list[dict]) -> list[int]:
    """What each router's belief would have predicted for the same routing decisions: every
    block of every prompt it routed to a worker counts as cached there, for ever."""
    belief: dict[tuple[int, str], set[int]] = {}
    predicted = []
    for record in records:
        hashes = extend_block_hashes([], record["prompt"], BLOCK_SIZE)
        limit = min(len(hashes), (len(record["prompt"]) - 1) // BLOCK_SIZE)
        held = belief.setdefault((record["router"], record["worker"]), set())
        num_blocks = next((i for i in range(limit) if hashes[i] not in held), limit)
        predicted.append(num_blocks * BLOCK_SIZE)
        held.update(hashes)
    return predicted


def figures(records: list[dict]) -> dict:
    real = [r["real"] for r in records]
    total_real = sum(real)

    def error(predicted: list[int]) -> float | None:
        absolute = sum(abs(p - r) for p, r in zip(predicted, real, strict=True))
        return absolute / total_real if total_real else None

    ttfts = [r["ttft_s"] for r in records]
    events_error = error([r["predicted"] for r in records])
    return {
        "num_requests": len(records),
        "real_hit_tokens": total_real,
        "events": {
            "predicted_hit_tokens": sum(r["predicted"] for r in records),
            "error": events_error,
        },
        "belief": {
            "predicted_hit_tokens": sum(belief_predictions(records)),
            "error": error(belief_predictions(records)),
        },
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "prompt_tokens_computed": sum(len(r["prompt"]) - r["real"] for r in records),
        "meets_target": events_error is not None and events_error <= TARGET_ERROR,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--num-topics", type=int, default=12)
    parser.add_argument("--topic-tokens", type=int, default=192)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="per worker")
    parser.add_argument("--restart-at", type=float, default=0.5, help="fraction of the run")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop sending after")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-routing-churn-") as log_dir:
        records = run(args, Path(log_dir))
    result = figures(records)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
