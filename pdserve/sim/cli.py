"""`pdserve simulate`, `pdserve simulate calibrate` and `pdserve plan`.

The top-level CLI registers them with `add_parsers(subparsers)` and runs `args.run(args)`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pdserve.sim.calibration import fit_efficiency, load_samples, save_samples
from pdserve.sim.cost_model import CostModel
from pdserve.sim.efficiency import calibration_for
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import load_model_spec
from pdserve.sim.options import (
    Deployment,
    add_deployment_args,
    add_workload_args,
    layout_config,
    parse_modes,
    slos_from_text,
    workload_from_args,
)
from pdserve.sim.plan_report import explain, format_ranking, plot_goodput_vs_split
from pdserve.sim.planner import PlanInputs, ProgressLines, band_of, gpus_for_rate, search
from pdserve.sim.profile_fit import (
    calibrate_points,
    calibrate_table,
    calibration_of,
    format_rows,
    load_points,
    load_profile,
    point_rows,
)
from pdserve.sim.report import bench_result, format_decisions, result_json, simulate_band
from pdserve.sim.simulator import simulate
from pdserve.workload.report import write_report
from pdserve.workload.summary import format_summary
from pdserve.workload.table import CompareRow, format_table


def add_parsers(subparsers) -> None:
    """Add `simulate` (with its `calibrate` subcommand) and `plan`."""
    sim = subparsers.add_parser(
        "simulate",
        help="simulate a cluster layout on the real scheduler",
        description="Discrete-event simulation of a serving layout: pdserve's own scheduler, "
        "block manager and router policies, with a physical cost model in place "
        "of the GPUs. Prints the benchmark's metrics.",
    )
    add_deployment_args(sim, with_layout=True)
    add_workload_args(sim)
    _add_output_args(sim)
    sim.set_defaults(run=run, sim_command=None)
    sub = sim.add_subparsers(dest="sim_command", metavar="{calibrate,scale}")
    scale = sub.add_parser(
        "scale",
        help="a bench demo's answer past this machine: re-predict its table, then goodput "
        "per core on larger CPU and GPU fleets",
        description="Calibrate from a `bench demo` run's own step logs, re-predict its "
        "measured table, then each mode's goodput per core on fleets of 4-64 cores and "
        "GPUs; writes DIR/scale.md, scale.json, scale.png.",
    )
    scale.add_argument("demo_dir", metavar="DIR", help="the demo's --report directory")
    scale.add_argument("--quiet", action="store_true", help="no progress lines")
    scale.add_argument(
        "--gpu",
        action="store_true",
        help="also an H100 fleet from its shipped calibration (at this machine's SLOs)",
    )
    cal = sub.add_parser(
        "calibrate",
        help="fit the cost model's efficiencies to measured engine steps",
        description="Fit efficiency factors and overheads to real engine step times and "
        "save them for --calibration.",
    )
    cal.add_argument("--model", default="SmolLM2-135M")
    cal.add_argument("--hardware", default="cpu-local")
    cal.add_argument("--tp", type=int, default=1)
    cal.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    source = cal.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--steps",
        metavar="FILE",
        nargs="+",
        help="step samples: JSONL such as `pdserve serve --step-log` writes, "
        "or benchmarks/engine.py --json output",
    )
    source.add_argument(
        "--bench",
        metavar="PROFILE.json",
        help="a profile of any OpenAI-compatible server, measured from outside: "
        "`pdserve bench --workload profile --save-result PROFILE.json`",
    )
    source.add_argument(
        "--points",
        metavar="FILE.json",
        help="published or hand-measured points (ttft, itl, static_batch, linear_layer; "
        'format: pdserve/sim/points.py), a list or a source file\'s {"points": [...]}; '
        "each on the deployment it names, else --model/--tp; other hardware left out",
    )
    source.add_argument(
        "--measure",
        action="store_true",
        help="run the real engine on this machine to measure steps",
    )
    cal.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="--bench: the server's chunked-prefill token budget (default: prompts prefill "
        "whole, as in colocated serving)",
    )
    cal.add_argument(
        "--hold-out",
        nargs="+",
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="--points: leave the points matching every pair of one spec out of the fit and "
        "report the error on them (e.g. tp=4, or kind=itl,num_streams=64)",
    )
    cal.add_argument("--stack", help="what was measured, for the record (default: the URL)")
    cal.add_argument("--num-threads", type=int, help="--measure: torch threads (cores)")
    cal.add_argument("--save-steps", metavar="FILE.jsonl", help="--measure: keep the samples")
    cal.add_argument("--output", default="calibration.json", help="(default: %(default)s)")

    plan = subparsers.add_parser(
        "plan",
        help="rank layouts of N GPUs by goodput per GPU under SLOs",
        description="Search colocated, chunked (token budgets 256-8192, TP degrees) and "
        "disaggregated layouts (prefill:decode splits, TP, local-prefill "
        "threshold, the decode workers' budget for those local prefills) of "
        "--gpus devices, simulate each, rank by goodput per GPU.",
    )
    add_deployment_args(plan, with_layout=False)
    plan.add_argument("--gpus", type=int, required=True)
    plan.add_argument(
        "--slo",
        nargs="+",
        required=True,
        metavar="METRIC:MS[,METRIC:MS]",
        help="e.g. ttft:500,tpot:50",
    )
    plan.add_argument(
        "--target-rate",
        type=float,
        help="inverse question: GPUs needed for this rate (default: --request-rate)",
    )
    plan.add_argument("--max-gpus", type=int, default=4096, help="inverse search bound")
    plan.add_argument("--top", type=int, default=20, help="rows of the table to print")
    add_workload_args(plan)
    _add_output_args(plan)
    plan.set_defaults(run=run, sim_command="plan")


# The top-level CLI looks for `add_parser`.
add_parser = add_parsers


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs, as bench")
    out.add_argument("--save-result", metavar="FILE.json")
    out.add_argument("--report", metavar="DIR")
    out.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    try:
        if args.sim_command == "calibrate":
            return _calibrate(args)
        if args.sim_command == "scale":
            return _scale(args)
        if args.sim_command == "plan":
            return _plan(args)
        return _simulate(args)
    except SimConfigError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    deployment = Deployment.from_args(args, with_layout=True)
    planned = workload_from_args(args, deployment.max_model_len)
    slos = slos_from_text(args.goodput)
    calibration = calibration_for(args.calibration, deployment.hardware.name)
    print(f"calibration: {calibration.describe()}")
    results, payload = [], {}
    for mode in parse_modes(args.mode):
        config = layout_config(deployment, mode, max_concurrency=planned.max_concurrency)
        sim = simulate(config, planned.specs)
        result = bench_result(
            sim,
            planned.workload,
            seed=planned.seed,
            request_rate=planned.request_rate,
            burstiness=planned.burstiness,
            slos=slos,
        )
        results.append(result)
        payload[result.label] = result_json(sim, result)
        print(format_summary(result))
        band = simulate_band(config, planned.specs, calibration, slos)
        if band is not None:
            print("\n".join(band.lines(result.metrics)))
            payload[result.label]["pdserve"]["simulation"]["band"] = band.to_dict()
        if sim.autoscale is not None:
            print(format_decisions(sim.autoscale))
        print(
            f"simulated {sim.duration_s:.1f} s of {config.num_devices} × "
            f"{config.hardware.name} in {sim.wall_time_s:.1f} s ({sim.num_events} events)\n"
        )
    if len(results) > 1:
        print(format_table([CompareRow.of(r.label, r) for r in results]))
    if args.save_result:
        data = next(iter(payload.values())) if len(payload) == 1 else {"runs": payload}
        _write_json(args.save_result, data)
    if args.report:
        path = write_report(
            results,
            args.report,
            "Simulated runs",
            preamble=f"Simulated with `pdserve simulate` ({deployment.model.name}"
            f" on {deployment.hardware.name}).",
        )
        print(f"report: {path}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    from pdserve.sim.scale import run_scale

    report = run_scale(Path(args.demo_dir), ProgressLines(args.quiet), args.gpu)
    print("\n".join(report.lines))
    print(f"report: {Path(args.demo_dir) / 'scale.md'}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    model, hardware = load_model_spec(args.model), get_hardware(args.hardware)
    cost_model = CostModel(model, hardware, args.tp, dtype=args.dtype)
    name = Path(args.output).stem
    deployment = {"model": model.name, "hardware": hardware.name, "tp": args.tp}
    if args.hold_out and not args.points:
        raise SimConfigError("--hold-out goes with --points")
    if args.bench:
        points, provenance = load_profile(args.bench)
        fit, measurements = calibrate_points(points, cost_model, args.max_num_batched_tokens)
        rows = point_rows(fit, measurements, points, cost_model)
        stack = args.stack or f"{provenance['model_id']} at {provenance['base_url']}"
        calibration = calibration_of(
            fit,
            name,
            rows,
            stack=f"measured from outside: {stack}",
            sources=[str(args.bench)],
            max_num_batched_tokens=args.max_num_batched_tokens,
            **deployment,
        )
        print(f"fit per point (profile of {stack}):\n{format_rows(rows)}")
    elif args.points:
        points = load_points(args.points)
        fit, rows, held = calibrate_table(
            points, cost_model, args.max_num_batched_tokens, args.hold_out
        )
        calibration = calibration_of(
            fit,
            name,
            rows + held,
            stack=args.stack or f"points from {args.points}",
            sources=[str(args.points)],
            max_num_batched_tokens=args.max_num_batched_tokens,
            hold_out=args.hold_out or [],
            **deployment,
        )
        print(f"fit per point ({args.points}):\n{format_rows(rows)}")
        if held:
            errors = [abs(r["residual"]) for r in held]
            print(
                f"held out, not fitted ({len(held)} points; mean |error| "
                f"{sum(errors) / len(errors):.1%}, max {max(errors):.1%}, "
                f"{sum(e <= 0.15 for e in errors)} within 15%):\n{format_rows(held)}"
            )
    else:
        if args.measure:
            from pdserve.sim.measure import measure_step_samples

            samples = measure_step_samples(num_threads=args.num_threads)
            if args.save_steps:
                save_samples(samples, args.save_steps)
        else:
            samples = [s for path in args.steps for s in load_samples(path)]
        fit = fit_efficiency(cost_model, samples)
        calibration = calibration_of(
            fit,
            name,
            None,
            stack=args.stack or "pdserve's engine, its own step times",
            sources=args.steps or ["--measure"],
            **deployment,
        )
    calibration.save(args.output)
    e = fit.efficiency
    print(
        f"fitted on {fit.num_samples} measurements ({fit.num_outliers} set aside as disturbed): "
        f"linear {e.linear_compute:.3f}, attention {e.attention_compute:.3f}, memory "
        f"{e.memory:.3f} of peak; overhead {e.step_overhead_s * 1e3:.2f} ms/step + "
        f"{e.per_seq_overhead_s * 1e3:.3f} ms/seq + {e.layer_overhead_s * 1e3:.3f} ms/layer + "
        f"{e.request_overhead_s * 1e3:.2f} ms/request; "
        f"error mean {fit.mean_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}; "
        f"band ±{fit.band:.1%} over every fitted point, set-aside ones included "
        f"(±{fit.kept_band:.1%} over the kept ones)"
    )
    if fit.at_bound:
        print(
            f"warning: {', '.join(fit.at_bound)} fitted at 100% of peak, the search's bound: "
            "the model has no term for what these points ask of it; read the band with care"
        )
    if e.linear_curve:
        print(
            f"linear layers: measured curve over {len(e.linear_curve)} row counts "
            f"({e.linear_curve[0][0]}-{e.linear_curve[-1][0]}), time ∝ rows beyond"
        )
    if e.step_jitter:
        quantiles = ", ".join(
            f"p{p} {e.step_jitter[round(p / 100 * (len(e.step_jitter) - 1))]:.2f}"
            for p in (10, 50, 90, 99)
        )
        print(f"step jitter (measured / modelled): {quantiles}")
    print(f"saved {args.output}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    deployment = Deployment.from_args(args)
    planned = workload_from_args(args, deployment.max_model_len)
    slos = slos_from_text(args.slo)
    if not slos:
        raise SimConfigError("--slo: give at least one of ttft:MS, tpot:MS, e2el:MS")
    calibration = calibration_for(args.calibration, deployment.hardware.name)
    print(f"calibration: {calibration.describe()}")
    inputs = PlanInputs(deployment, planned, slos, calibration.band)
    progress = ProgressLines(args.quiet)
    evaluations = search(inputs, args.gpus, progress)
    shown = evaluations[: args.top]
    bands = [band_of(inputs, e, progress) for e in shown]
    print(format_ranking(shown, bands=bands))
    if calibration.band:
        print(f"(latencies in ms, in parentheses with every step ±{calibration.band:.0%})")
    print()
    best = evaluations[0]
    print(explain(best, evaluations, band_of(inputs, best, progress, with_capacity=True)))
    target = args.target_rate or planned.request_rate
    if target is not None and math.isfinite(target):
        _inverse(args, inputs, evaluations, target, progress)
    if args.report:
        path = plot_goodput_vs_split(evaluations, Path(args.report) / "goodput_vs_split.png")
        print(f"plot: {path}")
    if args.save_result:
        _write_json(
            args.save_result,
            {
                "gpus": args.gpus,
                "slos_ms": slos,
                "request_rate": planned.request_rate,
                "ranking": [
                    {
                        "layout": e.label,
                        "goodput": e.goodput,
                        "goodput_per_gpu": e.goodput_per_gpu,
                        "attainment": e.attainment,
                        "binding_slo": e.binding_slo(),
                        **e.result.metrics.to_vllm_dict(),
                    }
                    for e in evaluations
                ],
            },
        )
    return 0


def _inverse(args, inputs: PlanInputs, evaluations, target: float, progress) -> None:
    """GPUs each of the top layouts' families needs to carry `target` req/s."""
    planned = workload_from_args(args, inputs.deployment.max_model_len, request_rate=target)
    print(f"\nGPUs to carry {target:g} req/s with >= 90% of requests within the SLOs:")
    seen = set()
    for evaluation in evaluations:
        family = evaluation.layout.mode
        if family in seen:
            continue
        seen.add(family)
        gpus = gpus_for_rate(
            inputs, evaluation.layout, target, planned.specs, args.max_gpus, progress
        )
        answer = f"{gpus} GPUs" if gpus else f"more than {args.max_gpus} GPUs"
        print(f"  {evaluation.layout.label(gpus or args.gpus)}: {answer}")


def _write_json(path: str, data: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1))
    print(f"saved {target}")
