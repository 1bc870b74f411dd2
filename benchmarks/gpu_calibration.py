"""The shipped GPU calibrations: fit them from published points, and check them.

    python benchmarks/gpu_calibration.py [--write] [--cpu-from DIR] [--out FILE.md]

`--write` refits `pdserve/sim/data/calibrations/*.json` from the points in
`pdserve/sim/data/sources/` (the sources and their conditions: docs/calibrations.md). Then,
printed (and written as markdown with `--out`):
1. each shipped calibration: its factors, band, and the residual of every fitting point;
2. each measured link: latency and efficiency fitted to its source, residual per point,
   against the catalog (`pdserve/sim/network.py`);
3. leave one source out: each calibration, fitted to TensorRT-LLM's tables alone, predicts
   a source it never saw: Vidur's kernel-level linear-layer times (same GPU, bf16) and, on
   H100, NVIDIA NIM's served Llama-3.3-70B latencies (closed-loop concurrency, simulated);
4. with `--cpu-from DIR` (the output of `benchmarks/sim_accuracy.py --profile`): this
   machine's pdserve server calibrated from outside (profile) against from its step logs,
   the same sim_accuracy figures from both.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from statistics import fmean

from pdserve.sim.calibration import fit_efficiency, fit_link
from pdserve.sim.config import Mode, PoolConfig, SimConfig, scheduler_config_for
from pdserve.sim.efficiency import SHIPPED_DIR, Calibration
from pdserve.sim.network import NETWORKS
from pdserve.sim.points import deployment, load_source, measurement
from pdserve.sim.profile_fit import calibration_of, point_rows
from pdserve.sim.simulator import simulate
from pdserve.sim.workload import SimRequestSpec

ENGINE_SOURCE = "trtllm-perf-v0.6"
KERNEL_SOURCE = "vidur-linear"
# What each shipped calibration is fitted to. H100: TensorRT-LLM's tables are FP8 only, so
# the 16-bit linear layers' and the memory's shares come from Vidur's bf16 kernel profiles,
# then everything else (FP8 GEMMs, attention, overheads) from TensorRT-LLM's tables at that
# memory share; the check left out is NIM's served figures. A100: TensorRT-LLM's FP16
# tables alone; the check left out is Vidur's A100 kernels.
SHIPPED = {
    "h100-sxm-trtllm": {
        "hardware": "H100-SXM",
        # H200 is the same Hopper chip with faster, larger HBM: it borrows these factors.
        "default_for": ["H100-SXM", "H200"],
        "summary": "TensorRT-LLM engine benchmark (FP8, static batching) over Vidur's bf16 "
        "kernel profiles",
        "kernel_source": KERNEL_SOURCE,
        "checks": ["nim-llama-3.3-70b"],
    },
    "a100-80gb-trtllm": {
        "hardware": "A100-80GB",
        "default_for": ["A100-80GB"],
        "summary": "TensorRT-LLM engine benchmark, FP16, static batching",
        "kernel_source": None,
        "checks": [KERNEL_SOURCE],
    },
}
LINK_SOURCE = "vidur-allreduce"
# NIM's engine: TensorRT-LLM's default token budget per step, vLLM-like sequence cap.
SERVING_BUDGET = 8192
SERVING_MAX_SEQS = 256
# Closed-loop requests per concurrency slot in the simulated NIM runs.
SERVING_ROUNDS = 4


def provenance(name: str) -> dict:
    source = load_source(name)
    keys = ("name", "title", "repository", "path", "commit", "url", "stack", "conditions")
    return {k: source[k] for k in keys if k in source}


def fit_shipped(name: str, spec: dict) -> Calibration:
    """Fit one shipped calibration (see SHIPPED) to its sources' points on its hardware."""
    kernel = spec["kernel_source"]
    memory, kernel_fit, kernel_rows = None, None, []
    if kernel is not None:
        # One shard's kernels only: sharded ones are short enough that a fixed launch time
        # the roofline has no term for dominates them (see the A100 check).
        kernel_fit, kernel_rows = _fit_source(kernel, spec["hardware"], None, tp=1)
        memory = kernel_fit.efficiency.memory
    fit, rows = _fit_source(ENGINE_SOURCE, spec["hardware"], memory)
    efficiency = fit.efficiency
    if kernel_fit is not None:
        # The engine's GEMMs are FP8: the 16-bit share is the kernels'.
        efficiency = replace(
            efficiency,
            linear_compute=kernel_fit.efficiency.linear_compute,
            fp8_linear_compute=efficiency.linear_compute,
        )
    sources = [s for s in (kernel, ENGINE_SOURCE) if s]
    return calibration_of(
        replace(fit, efficiency=efficiency),
        name,
        kernel_rows + rows,
        hardware=spec["hardware"],
        default_for=spec["default_for"],
        summary=spec["summary"],
        stack="; ".join(load_source(s)["stack"] for s in sources),
        sources=[provenance(s) for s in sources],
        checks=spec["checks"],
    )


def _fit_source(source: str, hardware: str, memory: float | None, tp: int | None = None):
    """The fit of one source's points on `hardware` (of TP `tp`, if given; each on its own
    deployment: model, TP, precision), and its rows. A few published points cannot pin a
    linear-layer curve's knots down: the roofline."""
    points = [{**p, "source": source} for p in load_source(source)["points"]]
    points = [p for p in points if p["hardware"] == hardware and tp in (None, p["tp"])]
    measurements = [measurement(p, deployment(p)) for p in points]
    fit = fit_efficiency(measurements[0].cost_model, measurements, allow_curve=False, memory=memory)
    return fit, point_rows(fit, measurements, points, measurements[0].cost_model)


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def describe_fit(calibration: Calibration) -> str:
    e, meta = calibration.efficiency, calibration.metadata
    header = (
        f"### {calibration.name}\n\n{meta['summary']} on {meta['hardware']} (default for "
        f"{', '.join(meta['default_for'])}). Linear layers at {e.linear_compute:.0%} of peak "
        f"FLOP/s, attention {e.attention_compute:.0%}, memory {e.memory:.0%} of peak "
        f"bandwidth; {e.step_overhead_s * 1e3:.2f} ms per step, "
        f"{e.per_seq_overhead_s * 1e6:.1f} µs per sequence, "
        f"{e.request_overhead_s * 1e3:.2f} ms per request, "
        f"{e.all_reduce_overhead_s * 1e6:.1f} µs per all-reduce{_fp8(e)}. Band "
        f"±{calibration.band:.1%} (90th percentile of |residual| over the engine's points); "
        f"{meta['fit']['num_outliers']} of them set aside by the robust fit.\n"
    )
    rows = [
        [
            p["label"],
            p.get("table", ""),
            f"{p['measured_s'] * 1e3:,.1f}",
            f"{p['predicted_s'] * 1e3:,.1f}",
            f"{p['residual']:+.1%}",
        ]
        for p in meta["points"]
    ]
    return header + "\n" + table(["point", "table", "measured ms", "model ms", "residual"], rows)


def _fp8(efficiency) -> str:
    share = efficiency.fp8_linear_compute
    return "" if share is None else f"; FP8 linear layers at {share:.0%} of the FP8 peak"


def link_report() -> str:
    points = load_source(LINK_SOURCE)["points"]
    lines = []
    for link_name in sorted({p["link"] for p in points}):
        link = NETWORKS[link_name]
        mine = [p for p in points if p["link"] == link_name]
        fit = fit_link(link.bandwidth, mine)
        lines.append(
            f"### {link_name}\n\nFitted to {len(mine)} all-reduces ({LINK_SOURCE}, fitted on "
            f">= 4 GPUs): latency {fit.latency_s * 1e6:.1f} µs, {fit.efficiency:.1%} of the "
            f"line rate; catalog: {link.latency_s * 1e6:.0f} µs, {link.efficiency:.0%}.\n"
        )
        rows = [
            [str(p["num_gpus"]), f"{p['bytes']:,}", f"{p['seconds'] * 1e6:,.0f}", f"{r:+.0%}"]
            for p, r in zip(mine, fit.residuals, strict=True)
        ]
        lines.append(table(["GPUs", "bytes", "measured µs", "residual"], rows))
    return "\n\n".join(lines)


def linear_check(calibration: Calibration) -> tuple[str, list[float]]:
    """Vidur's per-layer linear times on the calibration's GPU against the model's."""
    hardware = calibration.metadata["hardware"]
    rows, errors = [], []
    for p in load_source(KERNEL_SOURCE)["points"]:
        if p["hardware"] != hardware:
            continue
        model = deployment(p).with_efficiency(calibration.efficiency)
        predicted = model.layers_linear_s(p["num_tokens"]) / model.model.num_layers
        error = predicted / p["seconds"] - 1
        errors.append(error)
        rows.append(
            [
                p["model"],
                str(p["tp"]),
                str(p["num_tokens"]),
                f"{p['seconds'] * 1e3:.3f}",
                f"{predicted * 1e3:.3f}",
                f"{error:+.0%}",
            ]
        )
    text = table(["model", "TP", "tokens", "Vidur ms/layer", "model ms/layer", "error"], rows)
    return text, errors


def serving_check(calibration: Calibration) -> tuple[str, list[float]]:
    """NIM's served latencies against `pdserve simulate` of the same closed loop."""
    rows, errors = [], []
    for p in load_source("nim-llama-3.3-70b")["points"]:
        if p["hardware"] != calibration.metadata["hardware"]:
            continue
        ttft, itl = simulate_closed_loop(p, calibration)
        for name, measured, predicted in (("TTFT", p["ttft_ms"], ttft), ("ITL", p["itl_ms"], itl)):
            error = predicted / measured - 1
            errors.append(error)
            rows.append(
                [
                    f"{p['input_len']}/{p['output_len']}",
                    str(p["concurrency"]),
                    name,
                    f"{measured:,.1f}",
                    f"{predicted:,.1f}",
                    f"{error:+.0%}",
                ]
            )
    text = table(["ISL/OSL", "concurrency", "figure", "NIM ms", "simulated ms", "error"], rows)
    return text, errors


def simulate_closed_loop(point: dict, calibration: Calibration) -> tuple[float, float]:
    """Mean TTFT and ITL (ms) of `concurrency` clients each sending its next request when
    the last one ends, on one TP group of the point's deployment. The clients' first
    requests are spread over one request's span (as a benchmark's steady state has them,
    not all in one burst), and that first round is left out of the means."""
    cost = deployment(point)
    sched = scheduler_config_for(Mode.CHUNKED, SERVING_BUDGET, SERVING_MAX_SEQS, 131072)
    concurrency = point["concurrency"]
    config = SimConfig(
        cost.model,
        cost.hardware,
        Mode.CHUNKED,
        PoolConfig(1, cost.tp, sched),
        efficiency=calibration.efficiency,
        dtype=cost.dtype,
        kv_dtype=cost.kv_dtype,
        max_concurrency=concurrency,
    )
    span_s = (point["ttft_ms"] + (point["output_len"] - 1) * point["itl_ms"]) / 1e3
    # Later requests queue behind the staggered first ones: each goes out when one ends.
    starts = [span_s * i / concurrency for i in range(concurrency)]
    starts += [starts[-1]] * (concurrency * (SERVING_ROUNDS - 1))
    specs = [
        SimRequestSpec(str(i), start, point["input_len"], point["output_len"])
        for i, start in enumerate(starts)
    ]
    records = simulate(config, specs).records
    done = [r for r in records[concurrency:] if r.success]
    return fmean(r.ttft for r in done) * 1e3, fmean(g for r in done for g in r.itls) * 1e3


CHECKS = {KERNEL_SOURCE: linear_check, "nim-llama-3.3-70b": serving_check}


def cpu_report(directory: Path) -> str:
    """sim_accuracy's figures predicted from the step-log and from the profile calibration."""
    path = directory / "profile_vs_steps.json"
    if not path.is_file():
        return f"(no {path}: run benchmarks/sim_accuracy.py --profile --out {directory})"
    rows = json.loads(path.read_text())
    return table(
        ["mode", "figure", "measured ms", "step-log calibration", "profile calibration"],
        [
            [
                r["mode"],
                r["figure"],
                f"{r['measured']:.1f}",
                f"{r['steps']:.1f} ({r['steps'] / r['measured'] - 1:+.1%})",
                f"{r['profile']:.1f} ({r['profile'] / r['measured'] - 1:+.1%})",
            ]
            for r in rows
        ],
    )


def mean_abs(errors: list[float]) -> str:
    return f"mean |error| {fmean(abs(e) for e in errors):.0%}, max {max(map(abs, errors)):.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="refit the shipped calibrations")
    parser.add_argument("--cpu-from", type=Path, help="benchmarks/sim_accuracy.py --profile out")
    parser.add_argument("--out", type=Path, help="also write the report as markdown")
    args = parser.parse_args(argv)
    if args.write:
        for name, spec in SHIPPED.items():
            fit_shipped(name, spec).save(SHIPPED_DIR / f"{name}.json")
            print(f"wrote {SHIPPED_DIR / name}.json")
    sections = ["## Shipped calibrations: residual per fitting point"]
    sections += [describe_fit(Calibration.load(SHIPPED_DIR / f"{name}.json")) for name in SHIPPED]
    sections += ["## Links: all-reduce latency and efficiency", link_report()]
    sections.append("## Leave one source out")
    for name, spec in SHIPPED.items():
        calibration = Calibration.load(SHIPPED_DIR / f"{name}.json")
        for check in spec["checks"]:
            text, errors = CHECKS[check](calibration)
            sections.append(
                f"### {name} predicts {check} ({load_source(check)['stack'].split(':')[0]})"
                f"\n\n{mean_abs(errors)}.\n\n{text}"
            )
    if args.cpu_from:
        sections += [
            "## This machine: profile against step-log calibration",
            cpu_report(args.cpu_from),
        ]
    report = "\n\n".join(sections) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
