"""How well the calibrated simulator predicts real runs on this machine.

1. Calibrate on a separate run, so nothing is fitted to the answer: `pdserve bench compare`
   on the same kind of workload at another seed, every server logging its engine steps
   (`--step-log`); `pdserve simulate calibrate --steps` fits 1-thread hardware to the servers'
   and workers' steps (each runs one compute thread, the engine's default).
   Served steps carry what a scripted measurement misses: the HTTP server and the benchmark
   client sharing the two cores with the engine's threads.
2. Measure: `pdserve bench compare` on the workload and seed (all three modes, real servers).
3. Predict: replay each mode's requests (same arrival times, lengths, concurrency) through
   `pdserve simulate` with the matching layout and calibration.
4. Report TTFT p50/p99 and ITL p50/p99, predicted vs measured, per mode (target: within 15%).
   The measurement is repeated (`--repeats`, same workload and seed) and the prediction judged
   against the mean: tail figures of one run on a 2-vCPU VM move 20-30% between repeats.
5. With `--profile`, the servers are also calibrated from outside, as any server could be:
   `pdserve bench --workload profile` against a chunked `pdserve serve` on one thread,
   `pdserve simulate calibrate --bench`; and from the step log that same server wrote during
   its profile (inside: same server, same minutes). Every mode is predicted again with
   both, written beside the first predictions (profile_vs_steps.json, read by
   benchmarks/gpu_calibration.py --cpu-from DIR).

    .venv/bin/python benchmarks/sim_accuracy.py [--out DIR] [--num-prompts N]
        [--request-rate R] [--workload NAME] [--seed S] [--repeats N] [--reuse] [--profile]

`--reuse` skips runs whose outputs already exist in DIR (the step logs, compare*.json) and
refits the calibrations from the saved step logs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FIGURES = (
    ("TTFT p50", "median_ttft_ms"),
    ("TTFT p99", "p99_ttft_ms"),
    ("ITL p50", "median_itl_ms"),
    ("ITL p99", "p99_itl_ms"),
)
TARGET = 0.15
# Each mode's server as the simulator sees it, and the compute threads of each server or
# worker: one everywhere, the engine's default (README "CPU speed"); the other core serves
# HTTP, the benchmark client or the other worker.
LAYOUTS = {
    "colocated": ["--mode", "colocated"],
    "chunked": ["--mode", "chunked"],
    "disagg": ["--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "1"],
}
THREADS = {"colocated": 1, "chunked": 1, "disagg": 1}
# The calibration run's workload seed is the measured run's plus this: other prompts, other
# arrival times.
CALIBRATION_SEED = 1000


def pdserve(*argv: str) -> None:
    command = [sys.executable, "-m", "pdserve.cli", *argv]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def hardware(threads: int) -> str:
    return "cpu-local" if threads == 1 else f"cpu-local:{threads}"


def calibrate(out: Path, workload: list[str], reuse: bool) -> dict[int, Path]:
    """Serve the calibration run (logging steps) unless reused; fit each thread count."""
    logs = out / "calibration"
    if not (reuse and logs.exists()):
        for old in logs.glob("*.jsonl"):
            old.unlink()  # step logs append
        logs.mkdir(parents=True, exist_ok=True)
        pdserve(
            "bench",
            "compare",
            *workload,
            "--server-args",
            f"--step-log {logs}/steps-{{mode}}.jsonl",
            "--report",
            str(logs / "report"),
            "--save-result",
            str(logs / "compare.json"),
            "--no-progress",
        )
    calibrations = {}
    for threads in sorted(set(THREADS.values())):
        steps = [
            str(path)
            for mode, n in THREADS.items()
            if n == threads
            for path in sorted(logs.glob(f"steps-{mode}*.jsonl"))
        ]
        path = out / f"calibration-{threads}-thread.json"
        pdserve(
            "simulate",
            "calibrate",
            "--hardware",
            hardware(threads),
            "--steps",
            *steps,
            "--output",
            str(path),
        )
        calibrations[threads] = path
    return calibrations


def measure(out: Path, workload: list[str], reuse: bool, repeats: int) -> list[dict]:
    """`repeats` runs of the same workload and seed: the real system's own spread."""
    runs = []
    for repeat in range(1, repeats + 1):
        path = out / ("compare.json" if repeat == 1 else f"compare-{repeat}.json")
        if not (reuse and path.exists()):
            pdserve(
                "bench",
                "compare",
                *workload,
                "--report",
                str(out / f"measured-{repeat}"),
                "--save-result",
                str(path),
                "--no-progress",
            )
        runs.append(json.loads(path.read_text())["runs"])
    return runs


# The profile: prompts up to the mixed workload's longest documents; the servers' own budget.
PROFILE_LONGEST_PROMPT = 6000
SERVER_BUDGET = 512


def profile_calibrations(out: Path, reuse: bool) -> dict[str, dict[int, Path]]:
    """Each thread count's server profiled from outside while it logs its own steps; both
    calibrated: "profile" from outside, "inside" from the same run's step log (the same
    server at the same time: what tells the two ways apart, whatever the machine does)."""
    from pdserve.bench.launcher import LaunchConfig, launch_server

    calibrations: dict[str, dict[int, Path]] = {"profile": {}, "inside": {}}
    for threads in sorted(set(THREADS.values())):
        profile = out / f"profile-{threads}-thread.json"
        steps = out / f"profile-steps-{threads}-thread.jsonl"
        if not (reuse and profile.exists() and steps.exists()):
            steps.unlink(missing_ok=True)  # step logs append
            config = LaunchConfig(
                extra_args=("--num-threads", str(threads), "--step-log", str(steps)),
                log_dir=out / "profile-logs",
            )
            with launch_server(config, "chunked") as server:
                pdserve(
                    "bench",
                    "--base-url",
                    server.base_url,
                    "--workload",
                    "profile",
                    "--input-len",
                    str(PROFILE_LONGEST_PROMPT),
                    "--save-result",
                    str(profile),
                    "--no-progress",
                )
        for kind, source in (
            ("profile", ["--bench", str(profile)]),
            ("inside", ["--steps", str(steps)]),
        ):
            path = out / f"calibration-{kind}-{threads}-thread.json"
            budget = ["--max-num-batched-tokens", str(SERVER_BUDGET)] if kind == "profile" else []
            pdserve(
                "simulate",
                "calibrate",
                "--hardware",
                hardware(threads),
                *source,
                *budget,
                "--output",
                str(path),
            )
            calibrations[kind][threads] = path
    return calibrations


def predict(out: Path, mode: str, measured_run: Path, calibration: Path, tag: str = "") -> dict:
    path = out / f"predicted{tag}-{mode}.json"
    pdserve(
        "simulate",
        *LAYOUTS[mode],
        "--hardware",
        hardware(THREADS[mode]),
        "--workload-from",
        str(measured_run),
        "--calibration",
        str(calibration),
        "--save-result",
        str(path),
    )
    return json.loads(path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sim-accuracy"))
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", default="1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="measured runs of the workload; the prediction is judged "
        "against their mean (default: %(default)s)",
    )
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="also calibrate from a profile taken from outside"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workload = [
        "--workload",
        args.workload,
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        args.request_rate,
    ]
    calibrations = calibrate(
        args.out, [*workload, "--seed", str(args.seed + CALIBRATION_SEED)], args.reuse
    )
    workload += ["--seed", str(args.seed)]
    repeats = measure(args.out, workload, args.reuse, args.repeats)
    profiled = profile_calibrations(args.out, args.reuse) if args.profile else None
    rows, both = [], []
    for mode in LAYOUTS:
        measured = [runs[mode] for runs in repeats if mode in runs]
        if not measured:
            print(f"{mode}: no measured run (did its server fail?)", file=sys.stderr)
            continue
        # Same workload and seed in every repeat: the first one's requests stand for all.
        measured_path = args.out / f"measured-{mode}.json"
        measured_path.write_text(json.dumps(measured[0]))
        predicted = predict(args.out, mode, measured_path, calibrations[THREADS[mode]])
        from_profile = inside = None
        if profiled:
            threads = THREADS[mode]
            from_profile = predict(
                args.out, mode, measured_path, profiled["profile"][threads], "-profile"
            )
            inside = predict(args.out, mode, measured_path, profiled["inside"][threads], "-inside")
        for name, key in FIGURES:
            values = [run[key] for run in measured]
            rows.append(Row(mode, name, values, predicted[key]))
            if from_profile:
                mean = sum(values) / len(values)
                both.append(
                    {
                        "mode": mode,
                        "figure": name,
                        "measured": mean,
                        "steps": predicted[key],
                        "profile": from_profile[key],
                        "inside": inside[key],
                    }
                )
    table = format_table(rows)
    if rows:
        within = sum(abs(r.error) <= TARGET for r in rows)
        mean = sum(abs(r.error) for r in rows) / len(rows)
        table += (
            f"\n\nMean absolute error {mean:.1%}; {within} of {len(rows)} figures within "
            f"{TARGET:.0%}."
        )
    if both:
        (args.out / "profile_vs_steps.json").write_text(json.dumps(both, indent=1))
        table += "\n\n" + format_both(both)
    print(table)
    (args.out / "sim_accuracy.md").write_text(
        "# Simulator accuracy\n\n"
        + " ".join(workload)
        + f", {args.repeats} measured runs\n\n"
        + table
        + "\n"
    )
    return 0 if all(abs(r.error) <= TARGET for r in rows) else 1


@dataclass(frozen=True)
class Row:
    mode: str
    figure: str
    measured: list[float]  # one value per repeat
    predicted: float

    @property
    def mean(self) -> float:
        return sum(self.measured) / len(self.measured)

    @property
    def error(self) -> float:
        return (self.predicted - self.mean) / self.mean if self.mean else float("nan")

    @property
    def spread(self) -> float:
        """(max − min) / mean of the repeats: how far the real system disagrees with itself."""
        return (max(self.measured) - min(self.measured)) / self.mean if self.mean else 0.0


def format_both(rows: list[dict]) -> str:
    """Each figure predicted from the calibration run's step logs, from the profile (outside)
    and from the step log of the profile's own run (inside, same server, same time)."""
    lines = [
        "| mode | figure | measured ms (mean) | served steps | profile (outside) | profile's "
        "steps (inside) | outside vs inside |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r[k]:.1f} ({r[k] / r['measured'] - 1:+.1%})" for k in ("steps", "profile", "inside")
        ]
        lines.append(
            f"| {r['mode']} | {r['figure']} | {r['measured']:.1f} | {' | '.join(cells)} | "
            f"{r['profile'] / r['inside'] - 1:+.1%} |"
        )
    within = sum(abs(r["profile"] / r["inside"] - 1) <= TARGET for r in rows)
    lines.append(
        f"\nCalibrated from outside (profile) within {TARGET:.0%} of calibrated from the same "
        f"run's step log: {within} of {len(rows)} figures."
    )
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    lines = [
        "| mode | figure | measured ms (each run) | run-to-run spread | predicted ms | "
        "error vs mean |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "" if abs(r.error) <= TARGET else " ✗"
        runs = " / ".join(f"{v:.1f}" for v in r.measured)
        lines.append(
            f"| {r.mode} | {r.figure} | {runs} | {r.spread:.1%} | {r.predicted:.1f} | "
            f"{r.error:+.1%}{mark} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
