"""Soak: mixed traffic for a long while against `pdserve serve --mode disagg --autoscale`
(fleet secret on), then whether anything was lost or grew.

Client loops (--concurrency of them, bounded by --duration seconds and --max-requests in all)
each send, in turn, one of:
- ``long``: a fresh 300-600 word prompt (prefill worker, KV hand-off), 16 tokens;
- ``shared``: one of a few long prefixes plus a fresh tail (prefix caches, prefix routing);
- ``stream``: a streamed chat completion, 24 tokens;
- ``cancel``: a stream the client leaves after its first token;
- ``short``: a few words, 8 tokens;
- ``bad``: an invalid body (max_tokens -1), which must be a 400.

Every request's outcome is counted: ``ok`` (the whole answer, as many tokens as asked),
``refused`` (a 400 for a ``bad`` one, a 429/503 overload answer), ``cancelled`` (a ``cancel``
one), else ``failed`` with its reason; sent = the sum of them. Before the loops (after a
warm-up) and after them (once the fleet is idle) it reads the RSS and open file descriptors of
the router (the launcher's process) and of every worker (its children), and every worker's
KV blocks held (total minus free, from its /metrics, signed as the router signs); during them
it samples every process's RSS each --sample-interval seconds (growth in the second half is
a leak, not warm-up).

    flock /work/cpu.lock .venv/bin/python benchmarks/soak.py [--duration 1800] \\
        [--max-requests 100000] [--concurrency 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.api.signing import FleetAuth
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.bench.processes import num_held_blocks, process_facts, worker_pid
from pdserve.fleet import FLEET_SECRET_ENV

SECRET = "soak-fleet-secret"
KINDS = ("long", "shared", "stream", "cancel", "short", "bad")
WORDS = ("amber", "basin", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sample-interval", type=float, default=30.0, help="seconds between RSS samples"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-soak-"))
    print(f"logs in {logs}", file=sys.stderr, flush=True)
    config = LaunchConfig(
        extra_args=(
            *("--autoscale", "--worker-auth", "--worker-log-dir", str(logs / "workers")),
            *("--health-check-interval", "1", "--autoscale-interval", "5"),
            *("--autoscale-grace", "20", "--max-num-seqs", "8"),
        ),
        health_timeout_s=900.0,
        stop_grace_s=120.0,
        log_dir=logs,
        env={**os.environ, FLEET_SECRET_ENV: SECRET},
    )
    with launch_server(config, "disagg") as server:
        results = asyncio.run(soak(server.base_url, server.process.pid, args))
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if not results["outcomes"].get("failed") else 1


# ---- traffic ----------------------------------------------------------------------------


class Traffic:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.deadline = time.monotonic() + args.duration
        self.budget = args.max_requests
        self.sent = collections.Counter()
        self.outcomes = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.random = random.Random(args.seed)
        self.prefixes = [self.words(400) for _ in range(4)]
        self.serial = 0

    def words(self, count: int) -> str:
        return " ".join(self.random.choice(WORDS) for _ in range(count))

    def next_kind(self) -> str | None:
        if time.monotonic() >= self.deadline or self.budget <= 0:
            return None
        self.budget -= 1
        self.serial += 1
        return self.random.choice(KINDS)

    async def loop(self, http: httpx.AsyncClient) -> None:
        while (kind := self.next_kind()) is not None:
            self.sent[kind] += 1
            try:
                outcome = await self.send(http, kind, self.serial)
            except httpx.HTTPError as exc:
                outcome = f"failed: {type(exc).__name__}"
            if outcome.startswith("failed"):
                self.failures[f"{kind} {outcome}"] += 1
                outcome = "failed"
            self.outcomes[outcome] += 1

    async def send(self, http: httpx.AsyncClient, kind: str, serial: int) -> str:
        marker = f"request{serial}"  # a prompt of its own
        if kind in ("long", "shared", "short"):
            prompt = {
                "long": f"{marker} {self.words(self.random.randint(300, 600))}",
                "shared": f"{self.random.choice(self.prefixes)} {marker} {self.words(20)}",
                "short": f"{marker} {self.words(5)}",
            }[kind]
            max_tokens = 8 if kind == "short" else 16
            body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens}
            answer = await http.post(f"{self.url}/v1/completions", json={**body, "temperature": 0})
            return _judge(answer, lambda data: data["usage"]["completion_tokens"] == max_tokens)
        if kind == "bad":
            body = {"prompt": marker, "max_tokens": -1}
            answer = await http.post(f"{self.url}/v1/completions", json=body)
            if answer.status_code == 400:
                return "refused"
            return f"failed: bad request answered {answer.status_code}"
        return await self.stream(http, marker, leave_early=kind == "cancel")

    async def stream(self, http: httpx.AsyncClient, marker: str, leave_early: bool) -> str:
        body = {
            "messages": [{"role": "user", "content": f"{marker} {self.words(80)}"}],
            "max_tokens": 24,
            "min_tokens": 24,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as answer:
            if answer.status_code in (429, 503):
                return "refused"
            if answer.status_code != 200:
                return f"failed: HTTP {answer.status_code}"
            num_tokens, is_done = 0, False
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    is_done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"failed: stream error {chunk['error'].get('code')}"
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
                if leave_early and chunk.get("choices"):
                    return "cancelled"  # leaving the block closes the connection
        return "ok" if is_done and num_tokens == 24 else f"failed: {num_tokens} tokens"


def _judge(answer: httpx.Response, is_whole) -> str:
    if answer.status_code in (429, 503):
        return "refused"
    if answer.status_code != 200:
        return f"failed: HTTP {answer.status_code}"
    return "ok" if is_whole(answer.json()) else "failed: short answer"


# ---- the processes ------------------------------------------------------------------------


def held_blocks(url: str) -> int:
    return num_held_blocks(url, FleetAuth(SECRET))  # signed as the router signs


def rss_sample(url: str, launcher: int) -> dict[str, float]:
    """RSS and its anonymous part (MiB) of the router and of each worker now: `name` and
    `name anon`."""
    workers = httpx.get(f"{url}/workers", trust_env=False, timeout=30).json()["workers"]
    pids = {"router": launcher}
    for worker in workers:
        pid = worker_pid(launcher, worker["url"])
        if pid is not None:
            pids[worker["id"]] = pid
    sample = {}
    for name, pid in pids.items():
        facts = process_facts(pid)
        sample[name], sample[f"{name} anon"] = facts["rss_mib"], facts["anon_mib"]
    return sample


async def sample_rss(url: str, launcher: int, interval_s: float, samples: list) -> None:
    began = time.monotonic()
    while True:
        sample = await asyncio.to_thread(rss_sample, url, launcher)
        samples.append({"t": round(time.monotonic() - began, 1), **sample})
        await asyncio.sleep(interval_s)


def snapshot(url: str, launcher: int) -> dict[str, Any]:
    workers = httpx.get(f"{url}/workers", trust_env=False, timeout=30).json()["workers"]
    facts = {"router": process_facts(launcher), "workers": {}}
    for worker in workers:
        pid = worker_pid(launcher, worker["url"])
        if pid is None:
            continue
        facts["workers"][worker["id"]] = {
            **process_facts(pid),
            "role": worker["role"],
            "kv_blocks_held": held_blocks(worker["url"]),
        }
    return facts


async def soak(url: str, launcher: int, args: argparse.Namespace) -> dict[str, Any]:
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        warm = Traffic(url, argparse.Namespace(**{**vars(args), "max_requests": 2 * len(KINDS)}))
        for kind in KINDS:  # every path once, so the start figures are of a warm process
            await warm.send(http, kind, 0)
        start = snapshot(url, launcher)
        traffic = Traffic(url, args)
        began = time.monotonic()
        samples: list[dict[str, float]] = []
        sampler = asyncio.create_task(sample_rss(url, launcher, args.sample_interval, samples))
        await asyncio.gather(*(traffic.loop(http) for _ in range(args.concurrency)))
        seconds = time.monotonic() - began
        sampler.cancel()
    await asyncio.sleep(5.0)  # leases freed on the workers' next steps
    end = snapshot(url, launcher)
    decisions = httpx.get(f"{url}/autoscale", trust_env=False, timeout=30)
    return {
        "seconds": round(seconds, 1),
        "concurrency": args.concurrency,
        "sent": dict(traffic.sent),
        "num_sent": sum(traffic.sent.values()),
        "outcomes": dict(traffic.outcomes),
        "failures": dict(traffic.failures),
        "start": start,
        "end": end,
        "rss_samples": samples,
        "scaling_decisions": len(decisions.json().get("decisions", []))
        if decisions.status_code == 200
        else None,
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        f"soak: {results['num_sent']} requests in {results['seconds']} s, "
        f"{results['concurrency']} client loops; scaling decisions: "
        f"{results['scaling_decisions']}",
        f"sent by kind: {results['sent']}",
        f"outcomes: {results['outcomes']} (sum {sum(results['outcomes'].values())})",
    ]
    if results["failures"]:
        lines.append(f"failures: {results['failures']}")
    lines.append(
        f"{'process':<12} {'RSS MiB start':>14} {'end':>8} {'anon start':>11} {'end':>8} "
        f"{'fds start':>10} {'end':>5}"
    )
    start, end = results["start"], results["end"]
    rows = [("router", start["router"], end["router"])]
    rows += [(w, start["workers"].get(w), end["workers"][w]) for w in sorted(end["workers"])]
    for name, before, after in rows:
        first = before or {"rss_mib": "-", "anon_mib": "-", "fds": "-"}
        lines.append(
            f"{name:<12} {first['rss_mib']:>14} {after['rss_mib']:>8} {first['anon_mib']:>11} "
            f"{after['anon_mib']:>8} {first['fds']:>10} {after['fds']:>5}"
        )
    lines.append(
        "RSS MiB over the run (every sample; the second half shows a leak apart from warm-up; "
        "'anon' is the heap, the rest mapped files and shared KV segments):"
    )
    samples = results["rss_samples"]
    names = [n for p in ["router", *sorted(end["workers"])] for n in (p, f"{p} anon")]
    for name in names:
        values = [sample[name] for sample in samples if name in sample]
        if values:
            half = values[len(values) // 2]
            lines.append(
                f"  {name:<15} min {min(values)} max {max(values)} half-way {half} "
                f"last {values[-1]} ({len(values)} samples)"
            )
    held = {w: facts["kv_blocks_held"] for w, facts in end["workers"].items()}
    lines.append(f"KV blocks held at the end: {held}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
