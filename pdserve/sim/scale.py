"""`pdserve simulate scale DEMO_DIR`: the demo's question past this machine.

The demo (`bench demo`) measured every mode on this machine's cores, its servers logging their
engine steps. From those step logs alone (no separate calibration run) the simulator is
calibrated for one core (`cpu-local`), then:

1. it re-predicts the measured table: each mode, laid out as it ran (replicas, or P + D
   workers, with the demo's token budgets), on the demo's workload: its highest rate meeting
   the SLOs (the planner's capacity search) against the measured interval, and TTFT / ITL p99
   at the offered rate against the measured row, with the relative error (goal: 15%);
2. on the same traffic shape, sustained (the demo's requests per core, at least
   `MIN_PROMPTS_PER_CORE`, so every engine of a larger fleet is as loaded as the demo's were)
   each mode's goodput per core on fleets of `FLEET_SIZES` cores, disagg at its best P:D split
   of a few around the workload's prefill share; each search starts from the mode's capacity
   per core at the previous size, and a capacity at the search's ceiling is reported as a
   lower bound (">=") that decides no crossing;
3. with `gpu`, the same for a GPU fleet (`GPU_MODEL` on `GPU_HARDWARE`) at its shipped
   calibration: a prediction, with the range the calibration's band puts on every capacity,
   at SLOs the demo's own rule (`slo_rule` in sizing.json) gives the GPU's predicted prefill
   and decode step. Not in `make demo` (it doubles the section's time).

Where the best mode per core changes between two fleet sizes, the lines cross; the report says
where, that they do not, or that a lower bound leaves it open, with a plot of goodput per core
against fleet size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.sim.calibration import fit_efficiency, load_samples
from pdserve.sim.config import Mode
from pdserve.sim.cost_model import CostModel, SeqWork
from pdserve.sim.efficiency import calibration_for
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.layout import Layout
from pdserve.sim.model_spec import load_model_spec
from pdserve.sim.options import (
    Deployment,
    add_deployment_args,
    add_workload_args,
    workload_from_args,
)
from pdserve.sim.planner import (
    QUIET,
    PlanInputs,
    capacity_resolution,
    evaluate,
    find_capacity,
    search_ceiling,
)
from pdserve.sim.profile_fit import calibration_of
from pdserve.sim.workload import SimRequestSpec, plan_requests
from pdserve.workload.goodput import SearchPoint, SearchResult, sustained_count

FLEET_SIZES = (4, 8, 16, 64)
GPU_HARDWARE = "H100-SXM"
GPU_MODEL = "Llama-3.1-8B"
# A fleet run has the demo's requests per core, at least this many: fewer is a burst that
# any layout serves (the capacity search then ends at its ceiling).
MIN_PROMPTS_PER_CORE = 16
# The calibration fits at most this many logged steps (evenly spaced): the fit's time.
MAX_CALIBRATION_STEPS = 5000
# A GPU fleet's requests per GPU: as long a run as the demo's at the GPU's estimated
# capacity, up to this many (the simulation's time).
MAX_GPU_PROMPTS = 100
# Disagg's prefill shares tried per fleet: the workload's, and a quarter fewer and more
# prefill workers.
SPLIT_FACTORS = (0.75, 1.0, 1.33)
# Each fleet size's capacity search starts from the previous size's capacity per core, a
# close guess: it steps by this factor (the planner's own search doubles).
FLEET_SEARCH_GROWTH = 1.25
# Two capacities closer than this ratio are level: the search's bracket at its end.
SEARCH_RESOLUTION = capacity_resolution(FLEET_SEARCH_GROWTH)
GOAL = 0.15

Progress = Callable[[str], None]


@dataclass
class ScaleReport:
    """What `run_scale` found; `lines` the report's Markdown, `data` its JSON."""

    lines: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)


def run_scale(demo_dir: Path, progress: Progress = QUIET, gpu: bool = False) -> ScaleReport:
    """The scale section for a demo's results directory (module doc)."""
    sizing = json.loads((demo_dir / "sizing.json").read_text())
    compare = json.loads((demo_dir / "compare.json").read_text())
    steps = sorted((demo_dir / "steps").glob("*.jsonl"))
    if not steps:
        raise SimConfigError(f"{demo_dir / 'steps'} holds no step logs: run `bench demo` first")
    calibration_path = demo_dir / "calibration.json"
    _calibrate(steps, calibration_path)
    report = ScaleReport()
    cpu = _inputs(sizing, "cpu-local", "SmolLM2-135M", str(calibration_path))
    report.lines += _repredict(sizing, compare, cpu, report.data, progress)
    share = sizing["prefill_share"]
    num_cores = sizing["num_cores"]
    per_core_rate = sizing["request_rate"] / num_cores
    per_core_prompts = max(MIN_PROMPTS_PER_CORE, sizing["workload"]["num_prompts"] / num_cores)
    cpu_fleet = _fleet(sizing, cpu, per_core_rate, per_core_prompts, share, progress)
    report.data["cpu_fleet"] = cpu_fleet
    report.lines += _fleet_lines(
        "This machine's cores, calibrated from the demo's own step logs", cpu_fleet, "cores"
    )
    gpu_fleet = None
    if gpu:
        gpu_cal = calibration_for(None, get_hardware(GPU_HARDWARE).name)
        gpu_inputs = _inputs(sizing, GPU_HARDWARE, GPU_MODEL, None)
        slos, gpu_rate = _device_profile(sizing, gpu_inputs, gpu_cal)
        gpu_inputs = replace(gpu_inputs, slos=slos)
        # As long a run as the demo's, up to the simulation's time.
        prompts = min(MAX_GPU_PROMPTS, max(MIN_PROMPTS_PER_CORE, gpu_rate * sizing["run_s"]))
        gpu_fleet = _fleet(sizing, gpu_inputs, gpu_rate, prompts, share, progress)
        report.data.update(
            gpu_fleet=gpu_fleet,
            gpu_band=gpu_cal.band,
            gpu=gpu_cal.name,
            gpu_slos_ms=gpu_inputs.slos,
        )
        band = gpu_cal.band or 0.0
        report.lines += _fleet_lines(
            f"A GPU fleet: {GPU_MODEL} on {GPU_HARDWARE} (a prediction from the shipped "
            f"calibration {gpu_cal.name}, band ±{band:.0%}: each capacity lies in "
            "[c/(1+band), c/(1-band)]; SLOs by the demo's rule from the GPU's predicted "
            f"steps: {_slo_text(gpu_inputs.slos)})",
            gpu_fleet,
            "GPUs",
            band,
        )
    _plot(cpu_fleet, gpu_fleet, demo_dir / "scale.png")
    report.lines += ["", "![goodput per core against fleet size](scale.png)"]
    (demo_dir / "scale.json").write_text(json.dumps(report.data, indent=1))
    (demo_dir / "scale.md").write_text("\n".join(report.lines) + "\n")
    return report


def _calibrate(steps: Sequence[Path], path: Path) -> None:
    model, hardware = load_model_spec("SmolLM2-135M"), get_hardware("cpu-local")
    samples = [s for p in steps for s in load_samples(p)]
    samples = samples[:: math.ceil(len(samples) / MAX_CALIBRATION_STEPS)]
    fit = fit_efficiency(CostModel(model, hardware, 1), samples, is_served=True)
    calibration_of(
        fit,
        path.stem,
        None,
        stack="pdserve's engine in the demo's own runs (one thread per engine)",
        sources=[str(p) for p in steps],
        model=model.name,
        hardware=hardware.name,
        tp=1,
    ).save(path)


def _inputs(
    sizing: dict,
    hardware: str,
    model: str,
    calibration: str | None,
    num_prompts: int | None = None,
    rate: float | None = None,
) -> PlanInputs:
    """The demo's workload (`num_prompts` at `rate`, default the demo's) on `hardware`."""
    w = sizing["workload"]
    parser = argparse.ArgumentParser()
    add_deployment_args(parser, with_layout=True)
    add_workload_args(parser)
    argv = [
        *("--hardware", hardware, "--model", model),
        *(("--calibration", calibration) if calibration else ()),
        *("--workload", "mixed", "--seed", "0"),
        *("--num-prompts", str(num_prompts or w["num_prompts"])),
        *("--request-rate", f"{rate or sizing['request_rate']:.6g}"),
        *("--long-fraction", str(w["long_fraction"]), "--burst-size", str(w["burst_size"])),
        *("--chat-input-len", w["chat_input_len"], "--chat-output-len", w["chat_output_len"]),
        *("--long-input-len", w["long_input_len"], "--long-output-len", w["long_output_len"]),
    ]
    args = parser.parse_args(argv)
    deployment = Deployment.from_args(args)
    planned = workload_from_args(args, deployment.max_model_len)
    return PlanInputs(deployment, planned, dict(sizing["slos_ms"]))


def _layouts(
    sizing: dict, num_cores: int, prefill_share: float, factors: Sequence[float] = SPLIT_FACTORS
) -> dict[Mode, list[Layout]]:
    """Each mode's layouts as the demo ran them: replicas of one core, or P + D workers
    (one per factor of `prefill_share`, in order; neighbouring factors may give one split)."""
    args = sizing["mode_args"]
    chunk = int(args["chunked"][1])
    threshold = int(args["disagg"][1])
    decode_budget = int(args["disagg"][3].split()[-1])
    splits = [min(num_cores - 1, max(1, round(num_cores * prefill_share * f))) for f in factors]
    return {
        Mode.COLOCATED: [Layout(Mode.COLOCATED, 1)],
        Mode.CHUNKED: [Layout(Mode.CHUNKED, 1, budget=chunk)],
        Mode.DISAGG: [
            Layout(
                Mode.DISAGG,
                1,
                prefill_tp=1,
                prefill_fraction=p / num_cores,
                local_prefill_threshold=threshold,
                decode_budget=decode_budget,
            )
            for p in splits
        ],
    }


def _ran_layout(sizing: dict, mode: Mode) -> Layout:
    """`mode` laid out as the demo ran it on its cores (disagg at its measured split)."""
    num_cores = sizing["num_cores"]
    return _layouts(sizing, num_cores, sizing["disagg_split"][0] / num_cores, (1.0,))[mode][0]


def _sustained(
    inputs: PlanInputs, num_prompts: int, base_rate: float, seed: int = 0
) -> Callable[[float], list[SimRequestSpec]]:
    """The demo's requests at a rate as its search offers them: drawn with `seed`, as many
    as keep the span of `num_prompts` at `base_rate` (a sustained rate, not a burst)."""
    workload, max_len = inputs.planned.workload, inputs.deployment.max_model_len

    def specs_at(rate: float) -> list[SimRequestSpec]:
        count = sustained_count(num_prompts, base_rate, rate)
        resized = replace(workload, num_prompts=count)
        return plan_requests(resized, seed=seed, request_rate=rate, max_model_len=max_len)

    return specs_at


def _simulated_point(
    inputs: PlanInputs, layout: Layout, num_cores: int, run: SearchPoint
) -> SearchPoint:
    """A measured search run replayed in the simulator: the same requests (count and seed
    at its rate) on the same layout; how many met every SLO there."""
    specs = _sustained(inputs, run.num_requests, run.rate, run.seed or 0)(run.rate)
    evaluation = evaluate(inputs, layout, num_cores, specs, run.rate)
    num_good = evaluation.result.metrics.num_good or 0
    return SearchPoint(run.rate, num_good, len(specs), seed=run.seed)


def _repredict(
    sizing: dict, compare: dict, inputs: PlanInputs, data: dict, progress: Progress
) -> list[str]:
    """Each measured mode against the simulator: its search's runs replayed (the same
    requests at the same rates and seeds, judged by the same rule), its capacity searched
    on the same sustained load, and TTFT / ITL p99 of the run at the offered rate."""
    num_cores = sizing["num_cores"]
    num_prompts, rate = sizing["workload"]["num_prompts"], sizing["request_rate"]
    rows = {r["name"]: r for r in compare["rows"]}
    table = []
    for mode in Mode:
        row, search = rows.get(mode.value), compare.get("search", {}).get(mode.value)
        if row is None or row.get("error") or not search:
            continue
        layout = _ran_layout(sizing, mode)
        progress(f"[re-predict] {mode.value}")
        measured = SearchResult(
            search["slo_attainment"],
            tuple(SearchPoint(**{f: p[f] for f in _POINT_FIELDS}) for p in search["points"]),
        )
        replayed = SearchResult(
            measured.attainment,
            tuple(_simulated_point(inputs, layout, num_cores, p) for p in measured.points),
        )
        alike = sum(
            measured.meets(m) == replayed.meets(r)
            for m, r in zip(measured.points, replayed.points, strict=True)
        )
        sustained = _sustained(inputs, num_prompts, rate)
        capacity = find_capacity(inputs, layout, num_cores, progress, specs_at=sustained)
        m = evaluate(inputs, layout, num_cores).result.metrics
        table.append(
            {
                "mode": mode.value,
                "layout": row.get("layout", ""),
                "max_rate": [measured.max_rate, measured.min_missed_rate],
                "replayed_max_rate": [replayed.max_rate, replayed.min_missed_rate],
                "runs_alike": [alike, len(measured.points)],
                "predicted_max_rate": capacity,
                "ttft_p99": [row["ttft_p99"], m.ttft.p99],
                "itl_p99": [row["itl_p99"], m.itl.p99],
            }
        )
    data["repredicted"] = table
    lines = [
        "## Past this machine: the simulator, calibrated from this run's step logs",
        "",
        f"Measured (this run) against predicted (the simulator calibrated on the same run's "
        f"engine steps, each mode laid out as it ran on {num_cores} cores). The highest rate "
        "meeting the SLOs: measured, the same search runs replayed in the simulator (the same "
        "requests at the same rates and seeds, judged by the same rule; how many runs it calls "
        "as measured), and the simulator's own search on the same sustained load; TTFT and "
        f"ITL p99 at the offered rate, in ms. The goal is within {GOAL:.0%}.",
        "",
        "| mode | layout | max rate measured | replayed | runs alike | predicted | error "
        "| TTFT p99 measured | predicted | error | ITL p99 measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        alike, runs = t["runs_alike"]
        lines.append(
            f"| {t['mode']} | {t['layout']} | {_interval(*t['max_rate'])} | "
            f"{_interval(*t['replayed_max_rate'])} | {alike} of {runs} | "
            f"{t['predicted_max_rate']:.3g} | "
            f"{_interval_error(t['max_rate'], t['predicted_max_rate'])} | "
            f"{t['ttft_p99'][0]:.0f} | {t['ttft_p99'][1]:.0f} | {_error(*t['ttft_p99'])} | "
            f"{t['itl_p99'][0]:.1f} | {t['itl_p99'][1]:.1f} | {_error(*t['itl_p99'])} |"
        )
    return lines


_POINT_FIELDS = ("rate", "num_good", "num_requests", "goodput", "is_stopped_early", "seed")


def _interval(low: float | None, high: float | None) -> str:
    """A search's answer as "met-missed" (its highest rate met, its lowest missed)."""
    if low is None:
        return "none" + (f" (missed at {high:.3g})" if high else "")
    return f"{low:.3g}" + (f"-{high:.3g}" if high else "+")


def _interval_error(interval: list, predicted: float) -> str:
    """A predicted capacity against a measured interval: 0 inside it, else the relative
    distance to its nearer end."""
    low, high = interval
    if low is not None and predicted < low:
        return _error(low, predicted)
    if high is not None and predicted > high:
        return _error(high, predicted)
    if low is None and high is None:
        return "-"
    return "within"


def _error(measured: float, predicted: float) -> str:
    if not measured:
        return "-"
    error = (predicted - measured) / measured
    return f"{error:+.0%}" + ("" if abs(error) <= GOAL else " (over goal)")


def _device_profile(
    sizing: dict, inputs: PlanInputs, calibration
) -> tuple[dict[str, float], float]:
    """A simulated device's SLOs (ms), by the demo's rule from its predicted prefill and
    decode step, and its capacity (req/s) by the demo's estimate: each request costs its
    prefill and its share of batched decode steps."""
    rule, workload = sizing["slo_rule"], sizing["workload"]
    d = inputs.deployment
    cost = CostModel(d.model, d.hardware, 1, efficiency=calibration.efficiency)

    def prefill_s(num_tokens: float) -> float:
        return cost.step_time((SeqWork(round(num_tokens), 0, True),))

    step_s = cost.step_time((SeqWork(1, rule["batch_context"], True),) * rule["batch"])
    longest_doc = _high(workload["long_input_len"])
    slos = {
        "ttft": round(rule["ttft_prefills"] * prefill_s(longest_doc) * 1000, 1),
        "tpot": round(rule["tpot_steps"] * step_s * 1000, 1),
        "max_itl": round(rule["max_itl_steps"] * step_s * 1000, 1),
    }
    per_token = step_s / rule["batch"]
    docs = workload["long_fraction"]
    mean_cost = sum(
        share
        * (
            prefill_s(_mean(workload[f"{kind}_input_len"]))
            + _mean(workload[f"{kind}_output_len"]) * per_token
        )
        for kind, share in (("long", docs), ("chat", 1 - docs))
    )
    return slos, 1 / mean_cost


def _slo_text(slos: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:g} ms" for name, value in slos.items())


def _high(lengths: str) -> int:
    """The top of a workload's "LOW:HIGH" length range."""
    return int(str(lengths).split(":")[-1])


def _mean(lengths: str) -> float:
    low, _, high = str(lengths).partition(":")
    return (int(low) + int(high or low)) / 2


def _fleet(
    sizing: dict,
    base: PlanInputs,
    per_core_rate: float,
    per_core_prompts: float,
    share: float,
    progress: Progress,
) -> dict[str, dict]:
    """Each fleet size: each mode's best capacity per core (and disagg's split), with
    `is_bound` where the search never found a rate the layout misses; every fleet carries
    `per_core_prompts` requests per core at `base`'s SLOs, sustained (`_sustained`), the
    first search starting at `per_core_rate`. The layout families search in parallel, one
    process per core."""
    chains = [
        _Chain(sizing, base, mode, index, per_core_rate, per_core_prompts, share, progress)
        for mode, layouts in _layouts(sizing, FLEET_SIZES[0], share).items()
        for index in range(len(layouts))
    ]
    workers = min(len(chains), os.cpu_count() or 1)
    # fork: the workers see this module as the parent has it (tests patch FLEET_SIZES).
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        searched = list(pool.map(_Chain.run, chains))
    fleet: dict[str, dict] = {str(size): {} for size in FLEET_SIZES}
    for chain, capacities in zip(chains, searched, strict=True):
        for size, entry in capacities.items():
            best = fleet[size].get(chain.mode.value)
            if best is None or entry["capacity"] > best["capacity"]:
                fleet[size][chain.mode.value] = entry
    return fleet


@dataclass(frozen=True)
class _Chain:
    """One layout of a mode (disagg: at one of `SPLIT_FACTORS`) over the fleet sizes, each
    size's capacity search starting from the previous size's capacity per core (close, so
    it steps by `FLEET_SEARCH_GROWTH`, not doubling: fewer and smaller simulations)."""

    sizing: dict
    base: PlanInputs
    mode: Mode
    index: int
    per_core_rate: float
    per_core_prompts: float
    share: float
    progress: Progress

    def run(self) -> dict[str, dict]:
        d = self.base.deployment
        guess = self.per_core_rate
        capacities: dict[str, dict] = {}
        for size in FLEET_SIZES:
            num_prompts = math.ceil(self.per_core_prompts * size)
            inputs = _inputs(
                self.sizing, d.hardware.name, d.model.name, d.calibration, num_prompts, guess * size
            )
            inputs = replace(inputs, slos=self.base.slos)
            # Every rate at the span of `num_prompts` at the fleet's share of the demo's rate.
            specs_at = _sustained(inputs, num_prompts, self.per_core_rate * size)
            layout = _layouts(self.sizing, size, self.share)[self.mode][self.index]
            if d.hardware.name != "cpu-local":
                layout = _gpu_layout(layout)
            capacity = find_capacity(
                inputs,
                layout,
                size,
                self.progress,
                specs_at=specs_at,
                growth=FLEET_SEARCH_GROWTH,
            )
            capacities[str(size)] = {
                "capacity": capacity,
                "per_core": capacity / size,
                "layout": layout.label(size),
                "is_bound": capacity >= search_ceiling(inputs),
            }
            guess = capacity / size or self.per_core_rate
        return capacities


def _gpu_layout(layout: Layout) -> Layout:
    """The same family on a GPU: the GPU deployment's own token budgets."""
    return Layout(
        layout.mode,
        layout.tp,
        prefill_tp=layout.prefill_tp,
        prefill_fraction=layout.prefill_fraction,
        local_prefill_threshold=layout.local_prefill_threshold,
    )


def _fleet_lines(title: str, fleet: dict[str, dict], unit: str, band: float = 0.0) -> list[str]:
    sizes = list(fleet)
    lines = ["", f"### {title}", "", f"Goodput per {unit[:-1]} (req/s meeting the SLOs):", ""]
    lines += ["| mode | " + " | ".join(f"{s} {unit}" for s in sizes) + " |"]
    lines += ["|---|" + "---|" * len(sizes)]
    for mode in Mode:
        cells = []
        for size in sizes:
            entry = fleet[size].get(mode.value)
            if entry is None:
                cells.append("-")
                continue
            text = (">=" if entry.get("is_bound") else "") + f"{entry['per_core']:.3g}"
            if band:
                low, high = entry["per_core"] / (1 + band), entry["per_core"] / (1 - band)
                text += f" ({low:.3g}-{high:.3g})"
            if mode is Mode.DISAGG:
                text += f" [{entry['layout']}]"
            cells.append(text)
        lines.append(f"| {mode.value} | " + " | ".join(cells) + " |")
    lines += ["", crossing(fleet, unit)]
    return lines


def crossing(fleet: dict[str, dict], unit: str) -> str:
    """Where the best mode per core changes between fleet sizes, that it never does, or
    which sizes a lower bound (a capacity at the search's ceiling) leaves undecided."""
    open_sizes = [
        size
        for size, best in fleet.items()
        if any(entry.get("is_bound") for entry in best.values())
    ]
    decided = {size: best for size, best in fleet.items() if size not in open_sizes}
    open_note = (
        f" At {', '.join(open_sizes)} {unit} a capacity reached the search's ceiling (a lower "
        "bound), so the ranking there is left open."
        if open_sizes
        else ""
    )
    if not decided:
        return "The lines cannot be compared:" + open_note
    leaders = [(size, _leaders(best)) for size, best in decided.items()]
    # Between sizes with a clear leader (a tie between them leaves where it changed open).
    clear = [(size, modes[0]) for size, modes in leaders if len(modes) == 1]
    changes = [
        f"{b} overtakes {a} between {s} and {t} {unit}"
        for (s, a), (t, b) in itertools.pairwise(clear)
        if a != b
    ]
    level = [
        f"{' and '.join(modes)} are level at {size} {unit}"
        for size, modes in leaders
        if len(modes) > 1
    ]
    level_note = (
        f" Within the capacity search's resolution (±{SEARCH_RESOLUTION - 1:.0%}), "
        + "; ".join(level)
        + "."
        if level
        else ""
    )
    sizes = "every size" if not open_sizes else "every size decided"
    if not changes:
        if clear and not level:
            return f"The lines do not cross: {clear[0][1]} leads at {sizes}." + open_note
        return "The lines do not cross within the search's resolution." + level_note + open_note
    return "The lines cross: " + "; ".join(changes) + "." + level_note + open_note


def _leaders(best: dict[str, dict]) -> tuple[str, ...]:
    """The modes whose goodput per core is the best's within `SEARCH_RESOLUTION`, best
    first: one, a clear leader; more, a tie the capacity search cannot break."""
    top = max(entry["per_core"] for entry in best.values())
    near = [m for m, entry in best.items() if entry["per_core"] * SEARCH_RESOLUTION >= top]
    return tuple(sorted(near, key=lambda m: -best[m]["per_core"]))


def _plot(cpu: dict[str, dict], gpu: dict[str, dict] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(cpu, "CPU cores (calibrated here)")]
    if gpu is not None:
        panels.append((gpu, f"{GPU_MODEL} on {GPU_HARDWARE} (predicted)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (fleet, title) in zip(axes[0], panels, strict=True):
        sizes = [int(s) for s in fleet]
        for mode in Mode:
            per_core = [fleet[str(s)][mode.value]["per_core"] for s in sizes]
            ax.plot(sizes, per_core, marker="o", label=mode.value)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("fleet size")
        ax.set_ylabel("goodput per device (req/s)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
