"""Autoscaling at fleet scale, simulated: the Azure conversation trace's own shift between
output-heavy and input-heavy windows on fleets of 16 and 64 workers, the autoscaler against
every fixed prefill:decode split of the same workers (the best one chosen in hindsight).

    python benchmarks/fleet_autoscale.py [--fleets 16 64] [--out DIR]

1. Traffic: the trace from --window-start for --window seconds (by default minutes 18.5-21:
   prompts of ~1,100 tokens and ~250-token answers, then from minute 20 the input-heavy
   window, prompts ~1,400 and answers ~140), its arrivals compressed by --time-scale and
   each request repeated --copies-per-16 × (fleet / 16) times (spread over the gap to the
   next arrival), so that the load per worker is the same on every fleet.
2. Layouts: `disagg P:D` for each P in --prefill-shares × fleet, one --model on one
   --hardware per worker (TP1, the shipped calibration), and the router's autoscaler
   (`pdserve simulate --autoscale`) within the same workers, starting with --start-share
   of them prefilling and free to switch workers between the pools or drain them.
3. Figures: goodput (requests within --slo TTFT and TPOT per second of the traffic's span),
   worker-seconds (fixed: workers × run; autoscaled: each worker from its start to its end)
   and goodput per worker-second.

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


def run_fleet(args: argparse.Namespace, fleet: int) -> list[Row]:
    specs = traffic(args, fleet)
    span_s = args.window * args.time_scale
    slo = SLO.parse(args.slo)
    rows = []
    for share in args.prefill_shares:
        num_prefill = max(1, round(share * fleet))
        result = simulate(config(args, num_prefill, fleet - num_prefill, None), specs)
        rows.append(
            Row(
                fleet,
                f"fixed {num_prefill}:{fleet - num_prefill}",
                goodput(result, slo, span_s),
                fleet * result.duration_s,
                result.duration_s,
                len(specs),
                span_s,
            )
        )
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    start = max(1, round(args.start_share * fleet))
    scaling = AutoscaleConfig(
        min_prefill_workers=1,
        max_prefill_workers=fleet - 1,
        min_decode_workers=1,
        max_decode_workers=fleet - 1,
        max_workers=fleet,
        slo=slo,
        interval_s=args.interval,
        grace_s=args.grace,
    )
    autoscale = SimAutoscale(scaling, startup_s=args.startup, switch_s=args.switch)
    result = simulate(config(args, start, fleet - start, autoscale), specs)
    summary = result.autoscale
    rows.append(
        Row(
            fleet,
            f"autoscaled from {start}:{fleet - start} ({len(summary['decisions'])} decisions)",
            goodput(result, slo, span_s),
            summary["worker_seconds"],
            result.duration_s,
            len(specs),
            span_s,
        )
    )
    print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def render(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        "| fleet | layout | requests | goodput req/s | worker-seconds | goodput per "
        "worker-second | vs best fixed (goodput, worker-s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for fleet in args.fleets:
        mine = [r for r in rows if r.fleet == fleet]
        fixed = [r for r in mine if r.layout.startswith("fixed")]
        best = max(fixed, key=lambda r: r.goodput)
        for r in mine:
            goodput_ratio = r.goodput / best.goodput
            seconds_ratio = r.worker_seconds / best.worker_seconds
            versus = "best fixed" if r is best else f"x{goodput_ratio:.2f}, x{seconds_ratio:.2f}"
            lines.append(
                f"| {fleet} | {r.layout} | {r.num_requests:,} | {r.goodput:.1f} | "
                f"{r.worker_seconds:,.0f} | {r.per_worker_second:.3f} | {versus} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--trace", type=Path, default=default_trace_path())
    parser.add_argument("--window-start", type=float, default=1110.0, help="trace seconds")
    parser.add_argument("--window", type=float, default=150.0, help="trace seconds")
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--copies-per-16", type=float, default=1.5)
    parser.add_argument("--max-prompt", type=int, default=8000)
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--hardware", default="H100-SXM")
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prefill-shares", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--start-share", type=float, default=0.5)
    parser.add_argument("--slo", default="ttft:1000,itl:50", help="TTFT and TPOT targets, ms")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--grace", type=float, default=6.0)
    parser.add_argument("--startup", type=float, default=8.0, help="a new worker's start, s")
    parser.add_argument("--switch", type=float, default=1.0, help="a role switch, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for fleet in args.fleets for row in run_fleet(args, fleet)]
    text = render(rows, args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fleet_autoscale.md").write_text(text + "\n")
        data = [{**r.__dict__, "per_worker_second": r.per_worker_second} for r in rows]
        (args.out / "fleet_autoscale.json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
