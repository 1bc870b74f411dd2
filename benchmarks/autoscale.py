"""Autoscaling (with role switching) against the best fixed layout of the same cores, on the
Azure conversation trace replayed with a traffic shift; and what the simulator predicted.

1. Trace: two windows of the Azure LLM inference trace (conversation service), one after the
   other: first the input-heavy requests of one window (prompts >= --min-long-prompt tokens,
   outputs <= --max-short-output, capped at --max-prompt), then the output-heavy requests of
   the next (prompts <= --max-short-prompt, outputs >= --min-long-output, capped at
   --max-output). Each phase keeps the trace's own arrival pattern, compressed by its own
   time scale (a 2-core machine cannot keep the original pace for one and would idle through
   the other at it). Unless given (--input-time-scale, --output-time-scale, --goodput,
   --slo), the scales and SLOs are fitted to this machine: one core's measured prefill rate
   and decode step (`probe`, the engine on one pinned core) set phase 1 to offer
   --input-load times one core's prefill rate and phase 2 --output-load times one core's
   decode rate at 16 streams; TTFT SLO = 3x the longest prompt's prefill, TPOT SLO = 2x the
   16-stream decode step.
2. Layouts, one core per worker (on 2 vCPU: at most two workers beside the router):
   1 prefill + 1 decode; 0 + 2 (decode workers prefill their prompts themselves, in chunks);
   and --autoscale starting at 1 + 1 within two workers, which may switch a worker between
   the pools (1 + 1 <-> 0 + 2) or drain one. Each runs `pdserve serve --mode disagg` with step
   logs, and `pdserve bench` replays the trace against it with the SLOs (--goodput).
3. Worker-seconds: a fixed layout holds its workers for the whole run; the autoscaled one is
   integrated over its decisions (a worker counts from the decision that started it to the
   end of its drain).
4. The simulator: calibrated on the fixed layouts' step logs (one-thread workers), then
   `pdserve simulate --workload-from` replays each measured run's requests on its layout, the
   autoscaled one with `--autoscale` and the measured worker startup and switch times.
5. Report (--out): autoscale.md (the table, decisions, role-switch cost), autoscale.json,
   autoscale.png (pool sizes over time, measured and simulated).

Targets (issue 14): goodput >= 1.3x the best fixed layout's, or <= 0.75x its worker-seconds
at equal goodput; the simulated goodput within 15% of the measured.

    flock /work/cpu.lock .venv/bin/python benchmarks/autoscale.py [--out DIR] [--reuse]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from pdserve.workload.trace_file import (
    TraceEntry,
    default_trace_path,
    load_trace,
    write_trace_jsonl,
)

# The autoscaled run simulated with the live planner's decisions replayed (its row).
REPLAYED = "autoscale, live decisions replayed"
GOODPUT_TARGET = 1.3
WORKER_SECONDS_TARGET = 0.75
SIM_TARGET = 0.15
MAX_WORKERS = 2


@dataclass(frozen=True)
class Layout:
    name: str
    flags: tuple[str, ...]
    num_workers: int  # at the start
    is_autoscaled: bool = False


def layouts(args: argparse.Namespace) -> list[Layout]:
    scaling = (
        "--autoscale",
        *("--min-prefill-workers", "0", "--max-prefill-workers", "1"),
        *("--min-decode-workers", "1", "--max-decode-workers", str(MAX_WORKERS)),
        *("--max-workers", str(MAX_WORKERS), "--slo", args.slo),
        *("--autoscale-interval", str(args.interval), "--autoscale-grace", str(args.grace)),
    )
    return [
        Layout("1+1", ("--prefill-workers", "1", "--decode-workers", "1"), 2),
        Layout("0+2", ("--prefill-workers", "0", "--decode-workers", "2"), 2),
        Layout(
            "autoscale",
            ("--prefill-workers", "1", "--decode-workers", "1", *scaling),
            2,
            is_autoscaled=True,
        ),
    ]


# ---- the trace ---------------------------------------------------------------------------
def trace_phases(args: argparse.Namespace) -> tuple[list[TraceEntry], list[TraceEntry]]:
    """The input-heavy and the output-heavy requests, at the trace's own pace."""
    entries = load_trace(args.trace)
    first = _window(entries, args.window_start, args.window)
    second = _window(entries, args.window_start + args.window, args.window)
    inputs = [
        replace(e, prompt_len=min(e.prompt_len, args.max_prompt))
        for e in first
        if e.prompt_len >= args.min_long_prompt and e.output_len <= args.max_short_output
    ]
    outputs = [
        replace(e, output_len=min(e.output_len, args.max_output))
        for e in second
        if e.prompt_len <= args.max_short_prompt and e.output_len >= args.min_long_output
    ]
    return _rebased(inputs, 1.0, 0.0), _rebased(outputs, 1.0, 0.0)


def shifted_trace(
    phases: tuple[list[TraceEntry], list[TraceEntry]], args: argparse.Namespace
) -> tuple[list[TraceEntry], float]:
    """The two phases back to back at their time scales; the entries and when phase 2 starts."""
    inputs, outputs = phases
    phase_a = _rebased(inputs, args.input_time_scale, 0.0)
    shift_s = phase_a[-1].timestamp + args.gap
    return phase_a + _rebased(outputs, args.output_time_scale, shift_s), shift_s


PROBE = """
import json, os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
engine = LLMEngine.from_args(num_threads=1, max_num_seqs=64)
steps = []
engine.step_observers.append(lambda r: steps.append((r.batch, r.step_s)))
def run(prompts, max_tokens):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{len(steps)}-{i}", prompt, SamplingParams(max_tokens=max_tokens,
                           ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
run([[1000 + i for i in range(600)]], 4)  # warm-up
steps.clear()
prompt_len = int(sys.argv[1])
run([[2000 + i % 7000 for i in range(prompt_len)]], 1)
prefill_s = sum(s for _, s in steps)
steps.clear()
run([[3000 + 97 * j + i for i in range(64)] for j in range(16)], 40)
decode = sorted(s for batch, s in steps if len(batch) == 16 and all(n == 1 for n, _, _ in batch))
print(json.dumps({"prefill_tokens_per_s": prompt_len / prefill_s,
                  "decode_step_s": decode[len(decode) // 2]}))
"""


def probe(max_prompt: int) -> dict:
    """One pinned core's prefill rate (a --max-prompt prompt, default chunks) and its decode
    step with 16 streams."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(max_prompt)], check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def fit_to_machine(
    args: argparse.Namespace, phases: tuple[list[TraceEntry], list[TraceEntry]]
) -> dict:
    """Fill the time scales and SLOs not given from the measured speed of one core."""
    speed = probe(args.max_prompt)
    inputs, outputs = phases
    prompt_rate = sum(e.prompt_len for e in inputs) / max(inputs[-1].timestamp, 1.0)
    output_rate = sum(e.output_len for e in outputs) / max(outputs[-1].timestamp, 1.0)
    decode_rate = 16 / speed["decode_step_s"]
    if args.input_time_scale is None:
        args.input_time_scale = prompt_rate / (args.input_load * speed["prefill_tokens_per_s"])
    if args.output_time_scale is None:
        args.output_time_scale = output_rate / (args.output_load * decode_rate)
    ttft_ms = 3000 * args.max_prompt / speed["prefill_tokens_per_s"]
    tpot_ms = 2000 * speed["decode_step_s"]
    if args.goodput is None:
        args.goodput = [f"ttft:{ttft_ms:.0f}", f"tpot:{tpot_ms:.0f}"]
    if args.slo is None:  # the planner holds the pools to the goodput SLOs
        args.slo = ",".join(
            item.replace("tpot:", "itl:")
            for item in args.goodput
            if item.split(":")[0] in ("ttft", "tpot")
        )
    return speed


def _window(entries: list[TraceEntry], start: float, length: float) -> list[TraceEntry]:
    return [e for e in entries if start <= e.timestamp < start + length]


def _rebased(entries: list[TraceEntry], scale: float, offset: float) -> list[TraceEntry]:
    start = entries[0].timestamp
    return [replace(e, timestamp=offset + (e.timestamp - start) * scale) for e in entries]


# ---- running one layout ----------------------------------------------------------------
def pdserve_argv(*argv: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *argv]


@contextlib.contextmanager
def deployment(layout: Layout, out: Path, port: int) -> Iterator[str]:
    """`pdserve serve --mode disagg` with `layout`, every worker logging its steps."""
    logs = out / f"logs-{layout.name}"
    for old in logs.glob("steps*.jsonl"):
        old.unlink()  # step logs append
    logs.mkdir(parents=True, exist_ok=True)
    command = pdserve_argv(
        "serve",
        *("--mode", "disagg", "--port", str(port), "--worker-log-dir", str(logs)),
        *("--step-log", str(logs / "steps.jsonl"), "--health-check-interval", "1"),
        *layout.flags,
    )
    print("$", " ".join(command[2:]), flush=True)
    with open(logs / "launcher.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, layout.num_workers)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_ready(process: subprocess.Popen, url: str, num_workers: int) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the deployment exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            workers = httpx.get(f"{url}/workers", trust_env=False, timeout=5).json()["workers"]
            if sum(w["state"] == "healthy" for w in workers) == num_workers:
                return
        time.sleep(1.0)  # waiting for processes to load the model
    raise RuntimeError("the deployment did not become healthy")


def run_layout(layout: Layout, args: argparse.Namespace, trace: Path, port: int) -> dict:
    """Replay the trace against `layout`; its bench result, span and (autoscaled) log."""
    result_path = args.out / f"measured-{layout.name}.json"
    with deployment(layout, args.out, port) as url:
        started = _autoscale_state(url, layout)
        command = pdserve_argv(
            "bench",
            *("--base-url", url, "--workload", "trace", "--trace", str(trace)),
            *("--goodput", *args.goodput, "--save-result", str(result_path), "--no-progress"),
        )
        print("$", " ".join(command[2:]), flush=True)
        wall_start = time.monotonic()
        subprocess.run(command, check=True)
        wall_s = time.monotonic() - wall_start
        ended = _autoscale_state(url, layout)
        switch_costs = measure_idle_switches(url) if layout.is_autoscaled else []
    run = {
        "layout": layout.name,
        "result": str(result_path),
        "wall_s": wall_s,
        "worker_seconds": layout.num_workers * wall_s,
    }
    if layout.is_autoscaled:
        span = (started["uptime_s"], ended["uptime_s"])
        run.update(
            autoscale=ended,
            span=span,
            worker_seconds=worker_seconds(ended, layout.num_workers, span),
            idle_switches=switch_costs,
        )
    return run


def _autoscale_state(url: str, layout: Layout) -> dict | None:
    if not layout.is_autoscaled:
        return None
    return httpx.get(f"{url}/autoscale", trust_env=False, timeout=30).json()


def measure_idle_switches(url: str) -> list[dict]:
    """A worker moved to the other pool and back on the idle deployment: the switch alone."""
    costs = []
    for _ in range(2):
        workers = httpx.get(f"{url}/workers", trust_env=False, timeout=30).json()["workers"]
        decode = [w for w in workers if w["role"] == "decode" and w["state"] == "healthy"]
        prefill = [w for w in workers if w["role"] == "prefill" and w["state"] == "healthy"]
        worker, role = (prefill[0], "decode") if prefill else (decode[-1], "prefill")
        if not prefill and len(decode) < 2:
            break
        response = httpx.post(
            f"{url}/workers/{worker['id']}/role", json={"role": role}, trust_env=False, timeout=300
        )
        if response.status_code == 200:
            costs.append(response.json())
    return costs


def timeline(state: dict, num_prefill: int, num_decode: int) -> list[tuple[float, int, int]]:
    """(time, prefill workers, decode workers) after each change (`state`: GET /autoscale, or
    a simulation's autoscale summary); a change counts when it is done."""
    points = [(0.0, num_prefill, num_decode)]
    for outcome in state["outcomes"]:
        if outcome.get("error"):
            continue
        decision = outcome["decision"]
        prefill, decode = points[-1][1:]
        step = {"add": decision.get("num_workers", 1), "remove": -1}.get(decision["action"], 0)
        if decision["action"] == "switch":
            prefill, decode = (
                (prefill + 1, decode - 1)
                if decision["role"] == "prefill"
                else (prefill - 1, decode + 1)
            )
        elif decision["role"] == "prefill":
            prefill += step
        else:
            decode += step
        points.append((outcome["done_s"], prefill, decode))
    return points


def worker_seconds(state: dict, num_workers: int, span: tuple[float, float]) -> float:
    """Worker processes held over `span` (planner clock): a started worker from its decision,
    a removed one until its drain ended."""
    changes = []
    for outcome in state["outcomes"]:
        action = outcome["decision"]["action"]
        if action == "add":
            changes.append(
                (outcome["decision"]["time_s"], outcome["decision"].get("num_workers", 1))
            )
        elif action == "remove" and not outcome.get("error"):
            changes.append((outcome["done_s"], -1))
    start, end = span
    total, count, now = 0.0, num_workers, start
    for when, delta in sorted(changes):
        when = min(max(when, start), end)
        total += count * (when - now)
        count, now = count + delta, when
    return total + count * (end - now)


# ---- the simulator -----------------------------------------------------------------------
def calibrate(args: argparse.Namespace) -> Path:
    steps = [str(p) for name in ("1+1", "0+2") for p in (args.out / f"logs-{name}").glob("*.jsonl")]
    path = args.out / "calibration.json"
    command = pdserve_argv(
        "simulate", "calibrate", "--hardware", "cpu-local", "--steps", *steps, "--output", str(path)
    )
    subprocess.run(command, check=True)
    return path


def live_decisions(run: dict, path: Path) -> Path:
    """The autoscaled run's decisions on the replay's clock (the bench's start is 0), for
    `simulate --autoscale-decisions`."""
    offset = run["span"][0]
    decisions = [{**d, "time_s": d["time_s"] - offset} for d in run["autoscale"]["decisions"]]
    path.write_text(json.dumps({"decisions": decisions}, indent=1))
    return path


def predict(
    layout: Layout,
    run: dict,
    args: argparse.Namespace,
    calibration: Path,
    decisions: Path | None = None,
) -> dict:
    """The simulator on `layout` with the run's requests (`decisions`: the live planner's,
    replayed, instead of the simulated planner's own)."""
    name = layout.name if decisions is None else f"{layout.name}-replayed"
    path = args.out / f"predicted-{name}.json"
    flags = list(layout.flags)
    if decisions is not None:
        flags += ["--autoscale-decisions", str(decisions)]
    if layout.is_autoscaled:
        flags += ["--worker-startup", f"{run['startup_s']:.2f}"]
        flags += ["--role-switch-time", f"{run['switch_s']:.4f}"]
    mode = "disagg"
    if layout.name == "0+2":  # two workers prefilling their own prompts: chunked serving
        mode, flags = "chunked", ["--num-workers", "2"]
    command = pdserve_argv(
        "simulate",
        *("--mode", mode, "--hardware", "cpu-local", *flags),
        *("--workload-from", run["result"], "--calibration", str(calibration)),
        *("--goodput", *args.goodput, "--save-result", str(path)),
    )
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


# ---- report ------------------------------------------------------------------------------
def figures(result: dict) -> dict:
    return {
        "goodput": result.get("request_goodput") or 0.0,
        "ttft_p99_ms": result["p99_ttft_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
        "completed": result["completed"],
        "num_good": result["pdserve"]["num_good"],
    }


def plot(path: Path, measured: dict, simulated: dict | None, shift_s: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    offset = measured["span"][0]
    series = [("measured", measured["autoscale"], offset, "-")]
    if simulated is not None:
        series.append(("simulated", simulated, 0.0, "--"))
    for label, state, start, style in series:
        points = timeline(state, 1, 1)
        times = [max(t - start, 0.0) for t, _, _ in points]
        for index, (role, color) in enumerate((("prefill", "tab:blue"), ("decode", "tab:orange"))):
            counts = [p[index + 1] for p in points]
            ax.step(times, counts, where="post", ls=style, color=color, label=f"{role} ({label})")
        for decision in state["decisions"]:
            ax.axvline(decision["time_s"] - start, color="grey", lw=0.5, ls=style)
    ax.axvline(shift_s, color="k", lw=1.2)
    ax.text(shift_s, 2.05, " input-heavy | output-heavy", ha="center", va="bottom")
    ax.set(
        xlabel="time since the replay started (s)",
        ylabel="workers in the pool",
        ylim=(-0.1, 2.4),
        title="Autoscaled pools over the traffic shift (lines: decisions)",
    )
    ax.legend(loc="center right", fontsize="small")
    figure.savefig(path)


def report(args, runs: dict, predicted: dict, shift_s: float) -> tuple[str, dict]:
    rows, data = [], {}
    fixed = [name for name in runs if name != "autoscale"]
    best = max(fixed, key=lambda name: figures(runs[name]["measured"])["goodput"])
    # The autoscaled run twice: the simulated planner's own path, then the live one's.
    judged = [*runs.items(), *([(REPLAYED, runs["autoscale"])] if REPLAYED in predicted else [])]
    for name, run in judged:
        measured = figures(run["measured"])
        simulated = figures(predicted[name]) if name in predicted else None
        error = (
            (simulated["goodput"] - measured["goodput"]) / measured["goodput"]
            if simulated and measured["goodput"]
            else None
        )
        data[name] = {
            "measured": measured,
            "simulated": simulated,
            "worker_seconds": run["worker_seconds"],
            "sim_goodput_error": error,
        }
        rows.append(
            f"| {name}{' (best fixed)' if name == best else ''} | {measured['goodput']:.3f} | "
            f"{measured['num_good']}/{measured['completed']} | {measured['ttft_p99_ms']:.0f} | "
            f"{measured['itl_p99_ms']:.0f} | {run['worker_seconds']:.0f} | "
            + (
                f"{simulated['goodput']:.3f} ({error:+.0%})"
                if simulated and error is not None
                else "-"
            )
            + " |"
        )
    auto, base = data["autoscale"], data[best]
    ratio = (
        auto["measured"]["goodput"] / base["measured"]["goodput"]
        if base["measured"]["goodput"]
        else float("inf")
    )
    ws_ratio = auto["worker_seconds"] / base["worker_seconds"]
    verdict = {
        "best_fixed": best,
        "goodput_ratio": ratio,
        "worker_seconds_ratio": ws_ratio,
        "goodput_target_met": ratio >= GOODPUT_TARGET,
        "worker_seconds_target_met": ratio >= 0.98 and ws_ratio <= WORKER_SECONDS_TARGET,
        "sim_within_target": all(
            d["sim_goodput_error"] is not None and abs(d["sim_goodput_error"]) <= SIM_TARGET
            for name, d in data.items()
            if name != REPLAYED
        ),
        "sim_within_target_on_the_live_path": all(
            d["sim_goodput_error"] is not None and abs(d["sim_goodput_error"]) <= SIM_TARGET
            for name, d in data.items()
            if name != "autoscale"
        ),
    }
    lines = [
        "# Autoscaling vs fixed layouts (2 vCPU: at most two one-core workers + the router)",
        "",
        f"Trace: {args.trace.name}; input-heavy phase from {args.window_start:g} s "
        f"(x{args.input_time_scale:.3g} time), output-heavy phase from "
        f"{args.window_start + args.window:g} s (x{args.output_time_scale:.3g} time), shift at "
        f"{shift_s:.0f} s of the replay. SLOs: {' '.join(args.goodput)}; planner --slo "
        f"{args.slo}, interval {args.interval:g} s, grace {args.grace:g} s.",
        f"One core here: prefill {args.speed['prefill_tokens_per_s']:.0f} tokens/s, decode "
        f"step with 16 streams {args.speed['decode_step_s'] * 1000:.1f} ms.",
        "",
        "| layout | goodput (req/s) | good/completed | TTFT p99 ms | ITL p99 ms | "
        "worker-s | simulated goodput |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Autoscaled / best fixed ({best}): goodput x{ratio:.2f} (target >= {GOODPUT_TARGET}), "
        f"worker-seconds x{ws_ratio:.2f} (target <= {WORKER_SECONDS_TARGET} at equal goodput).",
        "",
        "Decisions (autoscaled run, planner clock):",
        "",
    ]
    auto_run = runs["autoscale"]
    offset = auto_run["span"][0]
    for outcome in auto_run["autoscale"]["outcomes"]:
        d = outcome["decision"]
        extra = ", ".join(
            f"{k} {outcome[k]:.3f} s"
            for k in ("router_drain_s", "worker_drain_s", "switch_s", "total_s", "drain_s")
            if isinstance(outcome.get(k), int | float)
        )
        lines.append(
            f"- {d['time_s'] - offset:7.1f} s: {d['action']} {d['role']} "
            f"{d['worker_id'] or ''} ({d['detail']}); done at {outcome['done_s'] - offset:.1f} s"
            + (f"; {extra}" if extra else "")
            + (f"; error: {outcome['error']}" if outcome.get("error") else "")
        )
    lines += ["", "Role switch on the idle deployment (router drain, worker drain, switch):", ""]
    for cost in auto_run["idle_switches"]:
        lines.append(
            f"- {cost['previous_id']} -> {cost['worker']['id']}: total {cost['total_s']:.3f} s "
            f"(router drain {cost['router_drain_s']:.3f} s, worker drain "
            f"{cost['worker_drain_s']:.3f} s, switch {cost['switch_s'] * 1000:.1f} ms)"
        )
    return "\n".join(lines) + "\n", {"layouts": data, "verdict": verdict}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("autoscale-bench"))
    parser.add_argument("--trace", type=Path, default=default_trace_path())
    parser.add_argument("--window-start", type=float, default=600.0, help="trace seconds")
    parser.add_argument("--window", type=float, default=200.0, help="trace seconds per phase")
    parser.add_argument("--min-long-prompt", type=int, default=1024)
    parser.add_argument("--max-short-output", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=1536)
    parser.add_argument("--max-short-prompt", type=int, default=400)
    parser.add_argument("--min-long-output", type=int, default=150)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--input-time-scale", type=float, help="default: fitted")
    parser.add_argument("--output-time-scale", type=float, help="default: fitted")
    parser.add_argument(
        "--input-load", type=float, default=0.9, help="phase 1: x one core's prefill rate"
    )
    parser.add_argument(
        "--output-load", type=float, default=1.4, help="phase 2: x one core's decode rate"
    )
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between the phases")
    parser.add_argument("--goodput", nargs="+", help="SLOs (default: fitted)")
    parser.add_argument("--slo", help="the planner's targets (default: the goodput SLOs)")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("--layouts", nargs="+", default=["1+1", "0+2", "autoscale"])
    parser.add_argument("--reuse", action="store_true", help="keep runs already in --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    phases = trace_phases(args)
    fitted_path = args.out / "fitted.json"
    if args.reuse and fitted_path.exists():
        vars(args).update(json.loads(fitted_path.read_text()))
    else:
        args.speed = fit_to_machine(args, phases)
        keys = ("speed", "input_time_scale", "output_time_scale", "goodput", "slo")
        fitted_path.write_text(json.dumps({k: getattr(args, k) for k in keys}, indent=1))
    entries, shift_s = shifted_trace(phases, args)
    trace = args.out / "shifted-trace.jsonl"
    write_trace_jsonl(entries, trace)
    num_input = sum(e.timestamp < shift_s for e in entries)
    print(
        f"trace: {num_input} input-heavy then {len(entries) - num_input} output-heavy "
        f"requests, {entries[-1].timestamp:.0f} s",
        flush=True,
    )
    runs_path = args.out / "runs.json"
    runs = json.loads(runs_path.read_text()) if args.reuse and runs_path.exists() else {}
    port = 18300 + os.getpid() % 500
    for layout in layouts(args):
        if layout.name in args.layouts and layout.name not in runs:
            runs[layout.name] = run_layout(layout, args, trace, port)
            runs_path.write_text(json.dumps(runs, indent=1))
    for run in runs.values():
        run["measured"] = json.loads(Path(run["result"]).read_text())
    auto = runs["autoscale"]
    adds = [o for o in auto["autoscale"]["outcomes"] if o["decision"]["action"] == "add"]
    switches = [o for o in auto["autoscale"]["outcomes"] if o["decision"]["action"] == "switch"]
    costs = [c["switch_s"] for c in auto["idle_switches"]] + [o["switch_s"] for o in switches]
    auto["startup_s"] = (
        sum(o["done_s"] - o["decision"]["time_s"] for o in adds) / len(adds) if adds else 8.0
    )
    auto["switch_s"] = sum(costs) / len(costs) if costs else 0.01
    calibration = calibrate(args)
    predicted = {
        layout.name: predict(layout, runs[layout.name], args, calibration)
        for layout in layouts(args)
        if layout.name in runs
    }
    autoscaled = next(layout for layout in layouts(args) if layout.is_autoscaled)
    decisions = live_decisions(auto, args.out / "live-decisions.json")
    predicted[REPLAYED] = predict(autoscaled, auto, args, calibration, decisions)
    text, data = report(args, runs, predicted, shift_s)
    simulated_log = predicted["autoscale"]["pdserve"].get("autoscale")
    plot(args.out / "autoscale.png", auto, simulated_log, shift_s)
    (args.out / "autoscale.md").write_text(text)
    (args.out / "autoscale.json").write_text(json.dumps(data, indent=1))
    print(text)
    print(json.dumps(data["verdict"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
