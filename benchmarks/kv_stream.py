"""TTFT of the streamed KV hand-off against pull-after-prefill and the prefill alone, on
shaped links between two hosts (issue 24).

Two network namespaces joined by a veth pair (`tests/router/netns.py`), both ends shaped
with `tc` tbf to each --rates value in turn: the prefill worker (chunked prefill,
--max-num-batched-tokens tokens a step) in A; the decode worker and two routers
(``--kv-handoff pull`` and ``stream``) in B; the client in B. For every link rate and prompt
length, each repeat sends a fresh prompt of random token ids (no prefix-cache hit anywhere)
three ways, in rotating order, and times the first streamed token at the client:

- alone:  straight to the prefill worker, a plain request (no transfer): the TTFT to beat
- pull:   through the pull router (the KV fetched after the prefill leg answered)
- stream: through the streaming router (each chunk's KV received while the next computes)

Medians per cell; with them the decode worker's exposed and hidden transfer
(`pdserve_timing`), and the simulator's prediction of pull and stream from the measured
prefill alone, the KV bytes the decode worker fetched and the link (`pdserve.sim.handoff`).
Every trial generates `OUTPUT_TOKENS` greedy tokens and the three ways must answer alike
(the decode worker's tokens are the prefill worker's, however its KV came). Needs root
(namespaces, tc).

    flock /work/cpu.lock .venv/bin/python benchmarks/kv_stream.py \\
        [--rates 10gbit 1gbit 100mbit] [--lengths 1024 4096] [--repeats 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.sim.handoff import predicted_ttft

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.router.netns import TwoHosts, rate_bits_per_s, shape_link, two_hosts  # noqa: E402

PORT = 8100
MODES = ("alone", "pull", "stream")
# Greedy tokens per trial: the first times the hand-off, the rest are compared across modes.
OUTPUT_TOKENS = 4
# Token ids drawn for prompts: ordinary vocabulary, no special tokens.
TOKEN_RANGE = (1000, 40000)


def serve(hosts: TwoHosts, ns: str, core: int, log: Path, *flags: str) -> subprocess.Popen:
    argv = ["taskset", "-c", str(core), sys.executable, "-m", "pdserve.cli", *flags]
    return subprocess.Popen(
        hosts.command(ns, argv), stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT
    )


def start(hosts: TwoHosts, logs: Path, chunk: int) -> list[subprocess.Popen]:
    # No prefix caching: the three ways of a trial send one prompt, each computed afresh.
    engine = ["--num-threads", "1", "--kv-transport", "tcp", "--num-kv-blocks", "1200"]
    engine += ["--no-prefix-caching"]
    prefill_url = f"http://{hosts.addr_a}:{PORT}"
    decode_url = f"http://{hosts.addr_b}:{PORT}"
    processes = [
        serve(
            hosts,
            hosts.ns_a,
            0,
            logs / "prefill.log",
            "serve",
            "--role",
            "prefill",
            "--mode",
            "chunked",
            "--max-num-batched-tokens",
            str(chunk),
            "--host",
            hosts.addr_a,
            "--port",
            str(PORT),
            "--kv-host",
            hosts.addr_a,
            *engine,
        ),
        serve(
            hosts,
            hosts.ns_b,
            1,
            logs / "decode.log",
            "serve",
            "--role",
            "decode",
            "--host",
            hosts.addr_b,
            "--port",
            str(PORT),
            *engine,
        ),
    ]
    for port, handoff in ((8001, "pull"), (8002, "stream")):
        processes.append(
            serve(
                hosts,
                hosts.ns_b,
                1,
                logs / f"router-{handoff}.log",
                "router",
                "--prefill",
                prefill_url,
                "--decode",
                decode_url,
                "--port",
                str(port),
                "--kv-handoff",
                handoff,
            )
        )
    deadline = time.monotonic() + 600
    routers = [url.replace("/v1/completions", "") for url in ROUTERS.values()]
    while not all(_routes_to_both(hosts, url) for url in routers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the routers never saw both workers healthy (logs in {logs})")
        time.sleep(1)
    return processes


def _routes_to_both(hosts: TwoHosts, router_url: str) -> bool:
    """Whether the router (in B) has both workers in rotation."""
    code = (
        "import httpx, sys\ntry:\n  w = httpx.get(sys.argv[1], trust_env=False).json()\n"
        "except (httpx.HTTPError, ValueError):\n  sys.exit(1)\n"
        "sys.exit(not all(x['state'] == 'healthy' for x in w['workers']) or len(w['workers']) < 2)"
    )
    argv = hosts.command(hosts.ns_b, [sys.executable, "-c", code, f"{router_url}/workers"])
    return subprocess.run(argv, capture_output=True).returncode == 0


ROUTERS = {
    "pull": "http://127.0.0.1:8001/v1/completions",
    "stream": "http://127.0.0.1:8002/v1/completions",
}


def plan(hosts: TwoHosts, lengths: list[int], repeats: int, seed: int) -> list[dict]:
    """Per length and repeat, one prompt of random token ids sent the three ways (rotating
    which goes first; the workers cache no prefix, so none finds another's KV), whose
    answers must be the same."""
    rng = random.Random(seed)
    urls = {"alone": f"http://{hosts.addr_a}:{PORT}/v1/completions", **ROUTERS}
    trials = []
    for length in lengths:
        for repeat in range(repeats):
            order = MODES[repeat % 3 :] + MODES[: repeat % 3]
            prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(length)]
            for mode in order:
                trials.append(
                    {
                        "length": length,
                        "repeat": repeat,
                        "mode": mode,
                        "url": urls[mode],
                        "prompt": prompt,
                    }
                )
    return trials


def client(trials: list[dict]) -> list[dict]:
    """Run inside namespace B: each trial's TTFT at the client and its pdserve_timing."""
    results = []
    with httpx.Client(trust_env=False, timeout=600) as http:
        for trial in trials:
            body = {
                "model": "default",
                "prompt": trial["prompt"],
                "max_tokens": OUTPUT_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            body.pop("model")
            started = time.perf_counter()
            ttft, timing, text = None, {}, ""
            with http.stream("POST", trial["url"], json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    choices = event.get("choices") or []
                    if ttft is None and choices:
                        ttft = time.perf_counter() - started
                    text += "".join(c.get("text") or "" for c in choices)
                    timing = event.get("pdserve_timing") or timing
            results.append(
                {
                    "length": trial["length"],
                    "repeat": trial["repeat"],
                    "mode": trial["mode"],
                    "ttft": ttft,
                    "timing": timing,
                    "text": text,
                }
            )
    return results


def measure(hosts: TwoHosts, trials: list[dict]) -> list[dict]:
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import kv_stream\n"
        "print(json.dumps(kv_stream.client(json.load(sys.stdin))))"
    )
    out = subprocess.run(
        hosts.command(hosts.ns_b, ["taskset", "-c", "1", sys.executable, "-c", code]),
        input=json.dumps(trials),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout)


def summarize(rate: str, results: list[dict], chunk: int) -> list[dict]:
    rows = []
    for length in sorted({r["length"] for r in results}):
        cell = {m: [r for r in results if r["length"] == length and r["mode"] == m] for m in MODES}
        ttft = {m: statistics.median(r["ttft"] for r in cell[m]) for m in MODES}

        def timing(mode: str, key: str, cell: dict = cell) -> float:
            return statistics.median(r["timing"].get(key, 0.0) for r in cell[mode]) / 1000

        answers = {}  # per repeat, the three ways' texts
        for r in results:
            if r["length"] == length:
                answers.setdefault(r["repeat"], set()).add(r["text"])
        prediction = predicted_ttft(  # the simulator's model, from the measured prefill
            prefill_s=ttft["alone"],
            num_bytes=statistics.median(r["timing"]["kv_transfer_bytes"] for r in cell["pull"]),
            bandwidth=rate_bits_per_s(rate) / 8,
            num_chunks=-(-length // chunk),
        )
        rows.append(
            {
                "rate": rate,
                "length": length,
                "ttft_s": ttft,
                "stream_over_alone": ttft["stream"] / ttft["alone"],
                "pull_exposed_s": timing("pull", "kv_transfer_exposed_ms"),
                "stream_exposed_s": timing("stream", "kv_transfer_exposed_ms"),
                "stream_hidden_s": timing("stream", "kv_transfer_hidden_ms"),
                "predicted_s": prediction,
                "is_same_output": all(len(texts) == 1 for texts in answers.values()),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "| link | prompt | alone | pull | stream | stream/alone | exposed pull | "
        "exposed stream | hidden stream | sim pull | sim stream | same greedy output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, p = r["ttft_s"], r["predicted_s"]
        print(
            f"| {r['rate']} | {r['length']} | {t['alone']:.3f} | {t['pull']:.3f} | "
            f"{t['stream']:.3f} | {r['stream_over_alone']:.2f}x | {r['pull_exposed_s']:.3f} | "
            f"{r['stream_exposed_s']:.3f} | {r['stream_hidden_s']:.3f} | {p['pull']:.3f} | "
            f"{p['stream']:.3f} | {'yes' if r['is_same_output'] else 'NO'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit", "100mbit"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512, help="prefill worker's token budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/pdserve-kv-stream"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with two_hosts() as hosts:
        processes = start(hosts, args.logs, args.chunk)
        try:
            # Warm-up: first requests pay for lazy initialisation, not for the hand-off.
            measure(hosts, plan(hosts, [256], 3, args.seed + 1))
            for index, rate in enumerate(args.rates):
                shape_link(hosts, rate)
                trials = plan(hosts, args.lengths, args.repeats, args.seed + 10 + index)
                rows += summarize(rate, measure(hosts, trials), args.chunk)
                print_table(rows[-len(args.lengths) :])
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)
    print()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if not all(r["is_same_output"] for r in rows):
        sys.exit("the three ways answered differently somewhere (the table's last column)")


if __name__ == "__main__":
    main()
