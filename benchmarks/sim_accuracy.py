"""How well the calibrated simulator predicts real runs on this machine.

1. Calibrate (a separate run from the measurement, so nothing is fitted to the answer): the
   real engine's step times on 2 threads (the colocated/chunked server) and on 1 thread (each
   disaggregated worker), fitted by `pdserve simulate calibrate --measure`.
2. Measure: `pdserve bench compare` on the workload and seed (all three modes, real servers).
3. Predict: replay each mode's requests (same arrival times, lengths, concurrency) through
   `pdserve simulate` with the matching layout and calibration.
4. Report TTFT p50/p99 and ITL p50/p99, predicted vs measured, per mode (target: within 15%).

    .venv/bin/python benchmarks/sim_accuracy.py [--out DIR] [--num-prompts N]
        [--request-rate R] [--workload NAME] [--seed S] [--reuse]

`--reuse` skips steps whose outputs already exist in DIR (calibrations, compare.json), and
refits calibrations from saved step samples rather than measuring again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FIGURES = (("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
           ("ITL p50", "median_itl_ms"), ("ITL p99", "p99_itl_ms"))
TARGET = 0.15
# Each mode's server as the simulator sees it, and the cores (threads) of each worker: the
# colocated/chunked server uses both cores, each disaggregated worker one.
LAYOUTS = {
    "colocated": ["--mode", "colocated"],
    "chunked": ["--mode", "chunked"],
    "disagg": ["--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "1"],
}
THREADS = {"colocated": 2, "chunked": 2, "disagg": 1}


def pdserve(*argv: str) -> None:
    command = [sys.executable, "-m", "pdserve.cli", *argv]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def hardware(threads: int) -> str:
    return "cpu-local" if threads == 1 else f"cpu-local:{threads}"


def calibrate(out: Path, threads: int, reuse: bool) -> Path:
    """Fit on `threads` cores; with --reuse, refit from saved steps instead of measuring."""
    path = out / f"calibration-{threads}-thread.json"
    steps = out / f"steps-{threads}-thread.jsonl"
    if reuse and path.exists():
        return path
    source = ["--steps", str(steps)] if reuse and steps.exists() else \
        ["--measure", "--num-threads", str(threads), "--save-steps", str(steps)]
    pdserve("simulate", "calibrate", "--hardware", hardware(threads), *source,
            "--output", str(path))
    return path


def measure(out: Path, workload: list[str], reuse: bool) -> dict:
    path = out / "compare.json"
    if not (reuse and path.exists()):
        pdserve("bench", "compare", *workload, "--report", str(out / "measured"),
                "--save-result", str(path), "--no-progress")
    return json.loads(path.read_text())["runs"]


def predict(out: Path, mode: str, measured_run: Path, calibration: Path) -> dict:
    path = out / f"predicted-{mode}.json"
    pdserve("simulate", *LAYOUTS[mode], "--hardware", hardware(THREADS[mode]),
            "--workload-from", str(measured_run),
            "--calibration", str(calibration), "--save-result", str(path))
    return json.loads(path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sim-accuracy"))
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", default="1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calibrations = {n: calibrate(args.out, n, args.reuse) for n in sorted(set(THREADS.values()))}
    workload = ["--workload", args.workload, "--num-prompts", str(args.num_prompts),
                "--request-rate", args.request_rate, "--seed", str(args.seed)]
    runs = measure(args.out, workload, args.reuse)
    rows = []
    for mode in LAYOUTS:
        if mode not in runs:
            print(f"{mode}: no measured run (did its server fail?)", file=sys.stderr)
            continue
        measured_path = args.out / f"measured-{mode}.json"
        measured_path.write_text(json.dumps(runs[mode]))
        predicted = predict(args.out, mode, measured_path, calibrations[THREADS[mode]])
        for name, key in FIGURES:
            real, sim = runs[mode][key], predicted[key]
            rows.append((mode, name, real, sim, (sim - real) / real if real else float("nan")))
    table = format_table(rows)
    print(table)
    (args.out / "sim_accuracy.md").write_text(
        "# Simulator accuracy\n\n" + " ".join(workload) + "\n\n" + table + "\n")
    return 0 if all(abs(r[4]) <= TARGET for r in rows) else 1


def format_table(rows) -> str:
    lines = ["| mode | figure | measured ms | predicted ms | error |", "|---|---|---|---|---|"]
    for mode, name, real, sim, error in rows:
        mark = "" if abs(error) <= TARGET else " ✗"
        lines.append(f"| {mode} | {name} | {real:.1f} | {sim:.1f} | {error:+.1%}{mark} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
