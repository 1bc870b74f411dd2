"""`pdserve bench`, `pdserve bench compare` and `pdserve bench convert-trace`.

The top-level CLI wires this in with `add_parser(subparsers)` and calls `run(args)`;
`python -m pdserve.bench ...` works on its own.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from pdserve.bench.benchmark import run_benchmark
from pdserve.bench.compare import (
    DEFAULT_MODES,
    CompareResult,
    CompareSpec,
    SavedRuns,
    judged,
    load_saved,
    run_compare,
    save_compare,
)
from pdserve.bench.demo import demo_spec, measure_machine, size_demo
from pdserve.bench.launcher import DEFAULT_SERVER_COMMAND, LaunchConfig
from pdserve.bench.layout import parse_split, resolve_cores
from pdserve.bench.search import RateSearch
from pdserve.flags import add_flags
from pdserve.workload import (
    default_trace_path,
    load_trace,
    make_workload,
    write_trace_jsonl,
)
from pdserve.workload.arrivals import parse_request_rates
from pdserve.workload.endpoint import CHAT_COMPLETIONS, COMPLETIONS, EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.flags import (
    TRACE_WINDOW_FLAGS,
    WORKLOAD_FLAGS,
    trace_window,
    workload_options,
)
from pdserve.workload.goodput import DEFAULT_ATTAINMENT
from pdserve.workload.interference import InterferenceConfig
from pdserve.workload.metrics import parse_goodput
from pdserve.workload.report import write_report
from pdserve.workload.results import save_results
from pdserve.workload.run import TRACE_WINDOW_STREAM, BenchSpec, seeded_rng
from pdserve.workload.summary import format_summary
from pdserve.workload.table import Layout, format_table
from pdserve.workload.tokenizer import load_tokenizer

_DESCRIPTION = (
    "Load-test an OpenAI-compatible server (pdserve, vLLM, llama.cpp) with streaming requests "
    "and report TTFT, TPOT, ITL, E2EL, throughput, goodput and phase interference."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench` (with its `compare` and `convert-trace` subcommands) to a CLI."""
    parser = subparsers.add_parser("bench", help="benchmark a server", description=_DESCRIPTION)
    configure_parser(parser)
    return parser


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Give `parser` the bench options and subcommands; `run(args)` executes the result."""
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server to benchmark (default: %(default)s)",
    )
    _add_run_args(parser, default_report=None)
    parser.set_defaults(run=run, bench_command=None)
    sub = parser.add_subparsers(dest="bench_command", metavar="{compare,demo,convert-trace}")
    compare = sub.add_parser(
        "compare",
        help="run one workload against each serving mode in turn",
        description="Start pdserve in each mode in turn, run the same workload and seed "
        "against each, and print one table plus a recommendation.",
    )
    _add_run_args(compare, default_report="bench-compare")
    _add_compare_args(compare)
    demo = sub.add_parser(
        "demo",
        help="the head-to-head fitted to this machine (make demo)",
        description="Measure this machine through one server, size the mixed workload, the "
        "SLOs and each mode's settings to it, then compare the modes and search each one's "
        "highest rate meeting the SLOs.",
    )
    _add_demo_args(demo)
    convert = sub.add_parser(
        "convert-trace",
        help="cut a window from a trace (e.g. the Azure CSV) into pdserve trace JSONL",
    )
    _add_convert_args(convert)


def run(args: argparse.Namespace) -> int:
    """Execute parsed `bench` arguments; the process exit code."""
    try:
        if args.bench_command == "compare":
            return _run_compare(args)
        if args.bench_command == "demo":
            return _run_demo(args)
        if args.bench_command == "convert-trace":
            return _run_convert(args)
        return _run_bench(args)
    except BenchError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench", description=_DESCRIPTION)
    configure_parser(parser)
    return run(parser.parse_args(argv))


# --- arguments -----------------------------------------------------------------------------


def _add_run_args(p: argparse.ArgumentParser, default_report: str | None) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT_COMPLETIONS])
    server.add_argument("--model", help="model name to request (default: the server's first)")
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--temperature", type=float, default=0.0)
    server.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    server.add_argument(
        "--tokenizer",
        help="tokenizer.json, a folder with one, or a GGUF (default: pdserve's default model)",
    )
    server.add_argument(
        "--max-model-len",
        type=int,
        help="context to fit requests into (default: what /v1/models reports)",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        help="req/s, 'inf' (all at once), or a sweep '0.5,1,2,4' "
        "(default: the workload's; mixed 1, trace its own pace, others inf)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 Poisson, <1 burstier",
    )
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests first")
    load.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:100 e2el:30000 max_itl:1000 (max_itl: a "
        "request whose longest gap between tokens exceeds it fails)",
    )
    load.add_argument("--no-progress", action="store_true", help="no progress bar")

    add_flags(p, "workload", WORKLOAD_FLAGS)

    out = p.add_argument_group("analysis and output")
    detector = InterferenceConfig()
    out.add_argument(
        "--spike-factor",
        type=float,
        help=f"a stall is a gap above this x its stream's pace (default {detector.spike_factor:g})",
    )
    out.add_argument(
        "--long-prompt-tokens",
        type=int,
        help="prompts at least this long count as long for the detector "
        f"(default {detector.long_prompt_tokens})",
    )
    out.add_argument(
        "--overload-factor",
        type=float,
        help="overload: streams this x slower than the unloaded step outside long prefills "
        f"(default {detector.overload_factor:g})",
    )
    out.add_argument("--save-result", metavar="FILE.json", help="write results as JSON")
    out.add_argument(
        "--report",
        metavar="DIR",
        default=default_report,
        help="write report.md and plots to DIR"
        + (" (default: %(default)s)" if default_report else ""),
    )


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("servers")
    g.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="comma-separated modes to launch, in order; '' for none",
    )
    g.add_argument(
        "--external",
        action="append",
        default=[],
        metavar="NAME=URL[@CORES]",
        help="an already-running server to add as a row (repeatable); @CORES declares the "
        "cores it runs on, without which it is shown but not ranked",
    )
    g.add_argument(
        "--saved",
        action="append",
        default=[],
        metavar="NAME=FILE.json",
        help="a saved run (bench or simulate --save-result, or a compare.json: every run of "
        "it) to add as rows, judged from its records like a measured run (with --goodput and "
        "the detector flags when given, else its own); with --modes '' and no --external "
        "only these",
    )
    _add_launch_args(g)
    _add_resource_args(g)
    g.add_argument(
        "--disagg-split",
        metavar="P:D",
        help="disagg's prefill and decode workers on the --cores (default: half and half; "
        "one each on two cores)",
    )
    found = p.add_argument_group("highest rate meeting the SLOs (goodput as DistServe defines it)")
    found.add_argument(
        "--search-rate",
        action="store_true",
        help="after the run at --request-rate, search each server's highest rate at which "
        "--slo-attainment of the requests meet every --goodput SLO",
    )
    search = RateSearch()
    found.add_argument(
        "--slo-attainment",
        type=float,
        help=f"share of requests that must meet the SLOs (default {search.attainment:g})",
    )
    found.add_argument(
        "--search-step",
        type=float,
        default=search.step,
        help="stop when the highest rate met and the lowest missed are within this ratio "
        "(default %(default)s)",
    )
    found.add_argument(
        "--search-max-runs",
        type=int,
        default=search.max_runs,
        help="runs per server besides the first (default %(default)s)",
    )
    found.add_argument(
        "--search-budget",
        type=float,
        metavar="SECONDS",
        help="per server: start no search run that would end after this long",
    )
    found.add_argument(
        "--seeds",
        type=int,
        default=CompareSpec.num_seeds,
        help="seeds the deciding runs (the highest rate met, the lowest missed) run with, "
        "the first included: each mode's answer becomes an interval (default %(default)s)",
    )


def _add_resource_args(g) -> None:
    g.add_argument(
        "--cores",
        type=int,
        metavar="N",
        help="every launched mode on the same N cores of this machine, one engine per core: "
        "colocated and chunked as N replicas, disagg as P prefill + D decode workers "
        "(default: every core)",
    )


def _add_launch_args(g) -> None:
    g.add_argument(
        "--server-cmd",
        default=" ".join(DEFAULT_SERVER_COMMAND),
        help="command template, placeholders {python} {mode} {host} {port} (default: %(default)s)",
    )
    g.add_argument(
        "--server-args",
        default="",
        help="extra arguments for every server, placeholders as --server-cmd "
        "(e.g. '--step-log steps-{mode}.jsonl')",
    )
    g.add_argument(
        "--mode-args",
        action="append",
        default=[],
        metavar="MODE=ARGS",
        help="extra arguments for one mode's server, after --server-args (repeatable), e.g. "
        '"chunked=--max-num-batched-tokens 256": compare each mode at its own best settings',
    )
    g.add_argument(
        "--health-timeout", type=float, default=600.0, help="seconds to wait for GET /health == 200"
    )
    g.add_argument(
        "--stop-grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL"
    )


def _add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="comma-separated modes to compare (default: %(default)s)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="the whole demo's time, the machine probe included (default: %(default)g)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json, a folder with one, or a GGUF (default: pdserve's default model)",
    )
    p.add_argument("--report", metavar="DIR", default="results/demo", help="(default: %(default)s)")
    p.add_argument(
        "--save-result", metavar="FILE.json", help="the JSON (default: DIR/compare.json)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    servers = p.add_argument_group("servers")
    _add_launch_args(servers)
    _add_resource_args(servers)


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", default=str(default_trace_path()), help="trace CSV or JSONL")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--num-prompts", type=int, help="requests to keep")
    p.add_argument("--seed", type=int, default=0, help="picks a random window start")
    add_flags(p, None, TRACE_WINDOW_FLAGS)


# --- building specs from arguments ---------------------------------------------------------


def _bench_spec(args: argparse.Namespace, base_url: str) -> BenchSpec:
    rates = parse_request_rates(args.request_rate) if args.request_rate else [None]
    workload = make_workload(
        args.workload, workload_options(args), seeded_rng(args.seed, TRACE_WINDOW_STREAM)
    )
    return BenchSpec(
        endpoint=EndpointConfig(
            base_url=base_url,
            endpoint=args.endpoint,
            model=args.model,
            api_key=args.api_key,
            temperature=args.temperature,
            request_timeout_s=args.timeout,
        ),
        workload=workload,
        seed=args.seed,
        request_rates=tuple(rates),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        slos=parse_goodput(args.goodput),
        interference=InterferenceConfig(**_detector_settings(args)),
        max_model_len=args.max_model_len,
        show_progress=not args.no_progress,
    )


def _detector_settings(args: argparse.Namespace) -> dict:
    """The detector flags given on the command line (the others keep their defaults)."""
    given = {
        "spike_factor": args.spike_factor,
        "long_prompt_tokens": args.long_prompt_tokens,
        "overload_factor": args.overload_factor,
    }
    return {k: v for k, v in given.items() if v is not None}


def _launch_config(args: argparse.Namespace, report_dir: Path) -> LaunchConfig:
    return LaunchConfig(
        command=tuple(shlex.split(args.server_cmd)),
        extra_args=tuple(shlex.split(args.server_args)),
        mode_args={
            mode: tuple(shlex.split(text))
            for mode, text in _name_pairs(args.mode_args, "--mode-args", "ARGS")
        },
        health_timeout_s=args.health_timeout,
        stop_grace_s=args.stop_grace,
        log_dir=report_dir / "logs",
    )


def _rate_search(args: argparse.Namespace) -> RateSearch | None:
    if not args.search_rate:
        return None
    return RateSearch(
        attainment=args.slo_attainment or DEFAULT_ATTAINMENT,
        step=args.search_step,
        max_runs=args.search_max_runs,
        budget_s=args.search_budget,
    )


def _name_pairs(items: list[str], flag: str, value: str) -> tuple[tuple[str, str], ...]:
    """NAME=VALUE items of a repeatable flag."""
    pairs = []
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name or not text:
            raise BenchError(f"{flag}: expected NAME={value}, got {item!r}")
        pairs.append((name, text))
    return tuple(pairs)


# --- commands ------------------------------------------------------------------------------


def _run_bench(args: argparse.Namespace) -> int:
    spec = _bench_spec(args, args.base_url)
    tokenizer = load_tokenizer(args.tokenizer)
    results = run_benchmark(spec, tokenizer)
    for result in results:
        print(format_summary(result))
    if args.save_result:
        print(f"results: {save_results(results, args.save_result)}")
    if args.report:
        title = f"pdserve bench: {spec.workload.name} against {spec.endpoint.base_url}"
        print(f"report: {write_report(results, args.report, title)}")
    return 0 if any(r.metrics.completed for r in results) else 1


def _run_compare(args: argparse.Namespace) -> int:
    saved = SavedRuns()
    slos = parse_goodput(args.goodput) if args.goodput else None
    for name, path in _name_pairs(args.saved, "--saved", "FILE.json"):
        load_saved(name, path, saved, slos, _detector_settings(args), args.slo_attainment)
    modes = tuple(m for m in args.modes.split(",") if m)
    externals = _name_pairs(args.external, "--external", "URL")
    report_dir = Path(args.report)
    if modes or externals:
        result = _measure_and_join(args, modes, externals, saved, report_dir)
    else:
        result = _judge_saved(args, saved)
    _print_and_save(result, report_dir, args.save_result)
    return 0


def _print_and_save(
    result: CompareResult, report_dir: Path, save_result: str | None, intro: list[str] = ()
) -> None:
    for name, run_result in result.results.items():
        print(f"{name}: {run_result.interference.verdict}")
    print(format_table(result.rows))
    for row in result.rows:
        if row.error:
            print(f"{row.name}: failed to run: {row.error}")
    for name, (search, _) in result.searches.items():
        print(f"{name}: highest rate meeting the SLOs {search.describe()}")
    if result.recommendation:
        print(result.recommendation)
    json_path, report = save_compare(result, report_dir, save_result, intro)
    print(f"results: {json_path}\nreport: {report}")


def _run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes:
        raise BenchError("bench demo: --modes is empty")
    report_dir = Path(args.report)
    # Every server logs its engine steps: what `pdserve simulate scale DIR` calibrates from.
    steps = report_dir / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    for old in steps.glob("*.jsonl"):
        old.unlink()  # step logs append
    launch = _launch_config(args, report_dir)
    step_log = ("--step-log", str(steps.resolve() / "steps-{mode}.jsonl"))
    launch = replace(launch, extra_args=(*launch.extra_args, *step_log))
    tokenizer = load_tokenizer(args.tokenizer)
    probe_mode = "colocated" if "colocated" in modes else modes[0]
    print(f"measuring this machine through a {probe_mode} server ...", flush=True)
    profile = measure_machine(launch, probe_mode, tokenizer, args.seed)
    num_cores = len(resolve_cores(args.cores))
    budget_s = args.time_budget - (time.monotonic() - started)
    plan = size_demo(profile, budget_s, len(modes), num_cores)
    for line in plan.explain():
        print(line, flush=True)
    spec = demo_spec(plan, launch, modes, args.seed, not args.no_progress)
    result = run_compare(spec, tokenizer)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "sizing.json").write_text(json.dumps(plan.to_dict(), indent=1))
    intro = ["## Sized for this machine", "", *(f"- {line}" for line in plan.explain()), ""]
    _print_and_save(result, report_dir, args.save_result, intro)
    print(f"demo: {time.monotonic() - started:.0f} s")
    return 0


def _measure_and_join(
    args: argparse.Namespace,
    modes: tuple[str, ...],
    externals: tuple[tuple[str, str], ...],
    saved: SavedRuns,
    report_dir: Path,
) -> CompareResult:
    """Measure the modes and externals; the saved runs join as rows judged alike."""
    spec = CompareSpec(
        # The base URL is replaced by each launched or external server's own.
        bench=_bench_spec(args, "http://127.0.0.1"),
        launch=_launch_config(args, report_dir),
        modes=modes,
        externals=externals,
        search=_rate_search(args),
        saved=tuple(saved.order),
        num_cores=args.cores,
        disagg_split=parse_split(args.disagg_split) if args.disagg_split else None,
        num_seeds=args.seeds,
    )
    measured = run_compare(spec, load_tokenizer(args.tokenizer))
    layouts = {r.name: Layout(r.num_engines, r.num_cores, r.layout) for r in measured.rows}
    return judged(
        spec,
        {**measured.results, **saved.results},
        {**measured.searches, **saved.searches},
        {**{r.name: r for r in measured.rows if r.error}, **saved.rows},
        [*(r.name for r in measured.rows), *saved.order],
        {**layouts, **saved.layouts},
    )


def _judge_saved(args: argparse.Namespace, saved: SavedRuns) -> CompareResult:
    """Saved runs alone, judged like measured ones (the first one's settings describe
    the comparison)."""
    if not saved.order:
        raise BenchError("bench compare: nothing to compare; give --modes, --external or --saved")
    first = next(iter(saved.results.values()), None)
    bench = first.spec if first else _bench_spec(args, "http://127.0.0.1")
    search = RateSearch(attainment=saved.attainment) if saved.attainment else None
    spec = CompareSpec(bench=bench, modes=(), search=search, saved=tuple(saved.order))
    return judged(spec, saved.results, saved.searches, saved.rows, saved.order, saved.layouts)


def _run_convert(args: argparse.Namespace) -> int:
    window = trace_window(args, args.num_prompts)
    entries = window.select(load_trace(args.input), seeded_rng(args.seed, TRACE_WINDOW_STREAM))
    write_trace_jsonl(entries, args.output)
    span = entries[-1].timestamp
    rate = (len(entries) - 1) / span if span > 0 else math.inf
    print(f"wrote {len(entries)} requests over {span:.1f} s ({rate:.2f} req/s) to {args.output}")
    return 0
