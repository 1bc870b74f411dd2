"""Autoscaling at fleet scale, simulated: the Azure conversation trace's own shift between
output-heavy and input-heavy windows on fleets of 16 and 64 workers, the autoscaler against
fixed prefill:decode layouts of the same workers or fewer (the best one chosen in hindsight).

    python benchmarks/fleet_autoscale.py [--fleets 16 64] [--out DIR]

1. Traffic: the trace from --window-start for --window seconds (by default minutes 17-37:
   ~300 requests a minute of ~1,100-token prompts and ~240-token answers, then from minute
   22 ten minutes of the input-heavy window, up to ~500 a minute of ~1,400-token prompts and
   ~140-token answers, then back), its arrivals compressed by --time-scale and each request
   repeated --copies-per-16 x (fleet / 16) times (spread over the gap to the next arrival),
   so that the load per worker is the same on every fleet. Compressed 10x, the 8 s worker
   startup stands for an 80 s one in the trace's time.
2. Layouts: `disagg P:D` for each P in --prefill-shares of each --sizes fraction of the
   fleet, one --model on one --hardware per worker (TP1, the shipped calibration), and the
   router's autoscaler (`pdserve simulate --autoscale`) within the fleet, starting with
   --start-size of it (--start-share of those prefilling), free to add workers (up to
   --max-step of the fleet at once), drain them or switch them between the pools.
3. Figures: goodput (requests within --slo TTFT and TPOT per second of the traffic's span),
   worker-seconds (fixed: workers x run; autoscaled: each worker from its start to its end)
   and goodput per worker-second; the autoscaled run against the best fixed layout (the
   most goodput, the fewest worker-seconds among ties) and against the cheapest fixed
   layout that reaches its goodput. --out adds the JSON and a plot of the offered prompt
   tokens and the autoscaled pools over time.

The live two-core check of the same autoscaler against the simulator is
benchmarks/autoscale.py (run under the CPU lock).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.core.config import Mode
from pdserve.router.autoscale.config import SLO, AutoscaleConfig
from pdserve.sim.config import PoolConfig, SimAutoscale, SimConfig, scheduler_config_for
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import load_model_spec
from pdserve.sim.simulator import SimResult, simulate
from pdserve.sim.workload import SimRequestSpec
from pdserve.workload.trace_file import default_trace_path, load_trace

# Goodputs within this fraction of each other count as equal (the simulator's noise is 0,
# but one request more or less on a 2,000-request run should not pick the layout).
TIE = 0.01


@dataclass(frozen=True)
class Row:
    fleet: int
    layout: str
    goodput: float
    worker_seconds: float
    duration_s: float
    num_requests: int

    span_s: float

    @property
    def per_worker_second(self) -> float:
        """Good requests per worker-second."""
        return self.goodput * self.span_s / self.worker_seconds


def traffic(args: argparse.Namespace, fleet: int) -> list[SimRequestSpec]:
    """The trace window, compressed, each request repeated for the fleet's size."""
    entries = [
        e
        for e in load_trace(args.trace)
        if args.window_start <= e.timestamp < args.window_start + args.window
    ]
    copies = args.copies_per_16 * fleet / 16
    rng = random.Random(args.seed)
    specs = []
    for this, after in zip(entries, [*entries[1:], None], strict=True):
        gap = (after.timestamp - this.timestamp) if after else 0.0
        start = (this.timestamp - args.window_start) * args.time_scale
        # A fractional count: the whole part, and one more with the fraction's chance.
        for _ in range(int(copies) + (rng.random() < copies % 1)):
            arrival = start + rng.random() * gap * args.time_scale
            prompt = min(this.prompt_len, args.max_prompt)
            specs.append(SimRequestSpec(str(len(specs)), arrival, prompt, max(1, this.output_len)))
    return sorted(specs, key=lambda s: s.arrival_time)


def config(args, num_prefill: int, num_decode: int, autoscale: SimAutoscale | None):
    model, hardware = load_model_spec(args.model), get_hardware(args.hardware)
    sched = scheduler_config_for(Mode.DISAGG, args.budget, args.max_num_seqs, 8192)
    return SimConfig(
        model,
        hardware,
        Mode.DISAGG,
        PoolConfig(num_decode, 1, sched),
        PoolConfig(num_prefill, 1, sched),
        autoscale=autoscale,
    )


def goodput(result: SimResult, slo: SLO, span_s: float) -> float:
    """Requests within both SLOs per second of the traffic's span (not the run's, whose
    tail after the last arrival differs between layouts that all keep up)."""
    ok = 0
    for r in result.records:
        if not r.success or r.ttft > slo.ttft_s:
            continue
        if r.tpot is None or r.tpot <= slo.itl_s:
            ok += 1
    return ok / span_s


def fixed_layouts(args: argparse.Namespace, fleet: int) -> list[tuple[int, int]]:
    """Every (prefill, decode) split of every --sizes fraction of the fleet, once each."""
    layouts = []
    for size in args.sizes:
        workers = max(2, round(size * fleet))
        for share in args.prefill_shares:
            num_prefill = min(max(1, round(share * workers)), workers - 1)
            if (num_prefill, workers - num_prefill) not in layouts:
                layouts.append((num_prefill, workers - num_prefill))
    return layouts


def run_fleet(args: argparse.Namespace, fleet: int) -> tuple[list[Row], dict]:
    """The fixed layouts' rows, then the autoscaled one's; and its run (`SimResult.autoscale`)."""
    specs = traffic(args, fleet)
    span_s = args.window * args.time_scale
    slo = SLO.parse(args.slo)
    rows = []
    for num_prefill, num_decode in fixed_layouts(args, fleet):
        result = simulate(config(args, num_prefill, num_decode, None), specs)
        rows.append(
            Row(
                fleet,
                f"fixed {num_prefill}:{num_decode}",
                goodput(result, slo, span_s),
                (num_prefill + num_decode) * result.duration_s,
                result.duration_s,
                len(specs),
                span_s,
            )
        )
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    workers = max(2, round(args.start_size * fleet))
    start = min(max(1, round(args.start_share * workers)), workers - 1)
    scaling = AutoscaleConfig(
        min_prefill_workers=1,
        max_prefill_workers=fleet - 1,
        min_decode_workers=1,
        max_decode_workers=fleet - 1,
        max_workers=fleet,
        slo=slo,
        interval_s=args.interval,
        grace_s=args.grace,
        max_step_workers=max(1, round(args.max_step * fleet)),
    )
    autoscale = SimAutoscale(scaling, startup_s=args.startup, switch_s=args.switch)
    result = simulate(config(args, start, workers - start, autoscale), specs)
    summary = result.autoscale
    rows.append(
        Row(
            fleet,
            f"autoscaled from {start}:{workers - start} ({len(summary['decisions'])} decisions)",
            goodput(result, slo, span_s),
            summary["worker_seconds"],
            result.duration_s,
            len(specs),
            span_s,
        )
    )
    print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows, summary


def best_fixed(rows: list[Row]) -> Row:
    """The fixed layout chosen in hindsight: the most goodput, and among layouts within
    `TIE` of it the fewest worker-seconds."""
    fixed = [r for r in rows if r.layout.startswith("fixed")]
    most = max(r.goodput for r in fixed)
    return min((r for r in fixed if r.goodput >= (1 - TIE) * most), key=lambda r: r.worker_seconds)


def cheapest_fixed_at(rows: list[Row], goodput: float) -> Row | None:
    """The fixed layout with the fewest worker-seconds that reaches `goodput` (within TIE)."""
    fixed = [r for r in rows if r.layout.startswith("fixed") and r.goodput >= (1 - TIE) * goodput]
    return min(fixed, key=lambda r: r.worker_seconds, default=None)


def render(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        "| fleet | layout | requests | goodput req/s | worker-seconds | goodput per "
        "worker-second | vs best fixed (goodput, worker-s) | worker-s vs the cheapest fixed "
        "layout with as much goodput |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fleet in args.fleets:
        mine = [r for r in rows if r.fleet == fleet]
        best = best_fixed(mine)
        for r in mine:
            goodput_ratio = r.goodput / best.goodput
            seconds_ratio = r.worker_seconds / best.worker_seconds
            versus = "best fixed" if r is best else f"x{goodput_ratio:.2f}, x{seconds_ratio:.2f}"
            cheapest = cheapest_fixed_at(mine, r.goodput)
            if r.layout.startswith("fixed"):
                at_goodput = ""
            elif cheapest is None:
                at_goodput = "no fixed layout reaches it"
            else:
                at_goodput = (
                    f"x{r.worker_seconds / cheapest.worker_seconds:.2f} ({cheapest.layout})"
                )
            lines.append(
                f"| {fleet} | {r.layout} | {r.num_requests:,} | {r.goodput:.1f} | "
                f"{r.worker_seconds:,.0f} | {r.per_worker_second:.3f} | {versus} | {at_goodput} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--trace", type=Path, default=default_trace_path())
    parser.add_argument("--window-start", type=float, default=1020.0, help="trace seconds")
    parser.add_argument("--window", type=float, default=1200.0, help="trace seconds")
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--copies-per-16", type=float, default=1.5)
    parser.add_argument("--max-prompt", type=int, default=8000)
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--hardware", default="H100-SXM")
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=[0.5, 0.75, 1.0],
        help="the fixed layouts' sizes, fractions of the fleet",
    )
    parser.add_argument("--prefill-shares", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument(
        "--start-size", type=float, default=0.5, help="the autoscaler's first workers (fraction)"
    )
    parser.add_argument("--start-share", type=float, default=0.5)
    parser.add_argument("--slo", default="ttft:1000,itl:50", help="TTFT and TPOT targets, ms")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--grace", type=float, default=6.0)
    parser.add_argument(
        "--max-step",
        type=float,
        default=0.25,
        help="the most workers one addition starts, a fraction of the fleet "
        "(--autoscale-max-step; 0: one at a time)",
    )
    parser.add_argument("--startup", type=float, default=8.0, help="a new worker's start, s")
    parser.add_argument("--switch", type=float, default=1.0, help="a role switch, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def pool_sizes(summary: dict) -> list[tuple[float, int, int]]:
    """(time, routable prefill workers, routable decode workers) at each planner tick."""
    return [
        (t["time_s"], t["signals"]["prefill"]["num_workers"], t["signals"]["decode"]["num_workers"])
        for t in summary["ticks"]
    ]


def offered_tokens(specs: list[SimRequestSpec], bin_s: float) -> tuple[list[float], list[float]]:
    """Prompt tokens per second arriving, in bins of `bin_s`: (bin starts, rates)."""
    num_bins = int(max(s.arrival_time for s in specs) // bin_s) + 1
    totals = [0.0] * num_bins
    for s in specs:
        totals[int(s.arrival_time // bin_s)] += s.prompt_len
    return [i * bin_s for i in range(num_bins)], [t / bin_s for t in totals]


def plot(path: Path, args: argparse.Namespace, runs: dict[int, dict]) -> None:
    """Per fleet: the prompt tokens offered, and the autoscaled pools following them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5 * len(runs), 5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, len(runs), sharex=True, squeeze=False)
    for column, (fleet, summary) in enumerate(runs.items()):
        top, bottom = axes[0][column], axes[1][column]
        starts, rates = offered_tokens(traffic(args, fleet), bin_s=2.0)
        top.step(starts, [r / 1000 for r in rates], where="post", color="tab:grey")
        top.set(ylabel="prompt k-tokens/s offered", title=f"fleet of {fleet}")
        sizes = pool_sizes(summary)
        times = [t for t, _, _ in sizes]
        for index, (role, color) in enumerate((("prefill", "tab:blue"), ("decode", "tab:orange"))):
            counts = [row[index + 1] for row in sizes]
            bottom.step(times, counts, where="post", color=color, label=role)
        bottom.set(xlabel="simulated seconds", ylabel="autoscaled workers", ylim=(0, fleet))
        bottom.legend(loc="upper left", fontsize="small")
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, runs = [], {}
    for fleet in args.fleets:
        fleet_rows, runs[fleet] = run_fleet(args, fleet)
        rows += fleet_rows
    text = render(rows, args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fleet_autoscale.md").write_text(text + "\n")
        data = {
            "rows": [{**r.__dict__, "per_worker_second": r.per_worker_second} for r in rows],
            "autoscaled": runs,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        (args.out / "fleet_autoscale.json").write_text(json.dumps(data, indent=1))
        plot(args.out / "fleet_autoscale.png", args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
