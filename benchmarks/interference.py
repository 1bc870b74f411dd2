"""Phase interference on 2 cores: colocated vs chunked prefill vs disaggregated (issue 4).

Each mode is started as a real `pdserve serve --mode ...` process on the same cores (colocated
and chunked: one server, all cores; disagg: router + a prefill worker on core 0 and a decode
worker on core 1, one thread each) with the default model and dtype. Against each: four
streaming chat requests (short prompt, 256 output tokens, ignore_eos); once every one has
streamed `--lead-tokens` tokens, one chat request with a 3,000-token prompt.

Reported per mode, for the short streams' token gaps (ITL):
- "during": gaps overlapping the long request's lifetime (send to last byte);
- "baseline": gaps while all four stream, outside that lifetime;
- the long request's TTFT and its breakdown (`pdserve_timing`: router queue, prefill leg, KV
  transfer ms/bytes, first decode step, the serving worker's queue and prefill time);
- KV bytes moved per prompt token (disagg).
Targets (issue 4): disagg ITL p99 during ≤ 1.3× baseline p50; chunked ≤ 3× with the budget
chosen here (each `--chunk-budgets` value is run; the largest that meets it is the pick);
colocated shows the stall (max gap ≈ the long prefill); shm ≥ ½ memcpy bandwidth, from
`benchmarks/kv_transfer.py` (loopback, and across a veth pair when root with iproute2).

Clients, records, metrics and plots are pdserve.bench's. The machine is shared: numbers move
run to run, so each mode also reports, before vs during the long request, the engine
processes' CPU share and run-queue wait (/proc schedstat), the decoding engine's mean step time
and step rate (its /metrics), and each core's busy and VM-steal time (/proc/stat): a decode
worker that gets less of its core shows up there, not only as ITL.

    .venv/bin/python benchmarks/interference.py [--out DIR] [--modes colocated chunked disagg]
        [--chunk-budgets 64 128 256] [--skip-transfer]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.client import make_http_client, send_request
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.bench.runner import probe_server, warm_up
from pdserve.workload.base import BenchRequest, Workload
from pdserve.workload.endpoint import CHAT_COMPLETIONS, EndpointConfig
from pdserve.workload.errors import BenchError
from pdserve.workload.interference import InterferenceConfig
from pdserve.workload.metrics import Distribution
from pdserve.workload.plots import plot_itl_timeline
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.records import RequestRecord
from pdserve.workload.run import WARMUP_OUTPUT_LEN, BenchSpec, seeded_rng, summarize
from pdserve.workload.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
# Targets of issue 4.
DISAGG_MAX_RATIO = 1.3
CHUNKED_MAX_RATIO = 3.0
MIN_STALL_FRACTION = 0.8  # colocated: the max gap covers most of the long prefill
MIN_SHM_VS_MEMCPY = 0.5
TIMING_KEYS = (
    "router_queue_ms",
    "prefill_ms",
    "kv_transfer_ms",
    "kv_transfer_bytes",
    "first_decode_step_ms",
    "worker_queue_ms",
    "worker_prefill_ms",
    "worker_ttft_ms",
)


@dataclass(frozen=True)
class Scenario:
    num_streams: int = 4
    short_prompt_tokens: int = 32
    short_output_tokens: int = 256
    long_prompt_tokens: int = 3000
    long_output_tokens: int = 16
    # Tokens every short stream has sent before the long request goes out.
    lead_tokens: int = 48
    seed: int = 0


@dataclass(frozen=True)
class ModeRun:
    """One server configuration: `pdserve serve --mode MODE EXTRA...`."""

    label: str
    mode: str
    extra_args: tuple[str, ...] = ()
    max_ratio: float | None = None  # the ITL target, when the mode has one


def mode_runs(modes: list[str], budgets: list[int]) -> list[ModeRun]:
    runs = []
    for mode in modes:
        if mode == "chunked":
            runs += [
                ModeRun(
                    f"chunked-{b}", mode, ("--max-num-batched-tokens", str(b)), CHUNKED_MAX_RATIO
                )
                for b in budgets
            ]
        elif mode == "disagg":
            runs.append(
                ModeRun(
                    mode,
                    mode,
                    ("--prefill-workers", "1", "--decode-workers", "1"),
                    DISAGG_MAX_RATIO,
                )
            )
        else:
            runs.append(ModeRun(mode, mode))
    return runs


# ---- one run ------------------------------------------------------------------------------


class CpuProbe:
    """Scheduler accounting (/proc/PID/task/*/schedstat) of the engine processes: how much CPU
    they got and how long they sat runnable waiting for it (other processes on their cores),
    plus the decoding engine's own step times (its /metrics). Tells our own interference from
    the shared machine's."""

    def __init__(self, pids: dict[str, int], decode_url: str) -> None:
        self.pids = pids
        self.decode_url = decode_url
        self.marks: list[tuple] = []

    def mark(self) -> None:
        self.marks.append(
            (
                time.perf_counter(),
                {name: _schedstat(pid) for name, pid in self.pids.items()},
                _step_time_sum_count(self.decode_url),
                _core_ticks(),
            )
        )

    def shares(self, start: int, end: int) -> dict[str, dict[str, float]]:
        """Between marks `start` and `end`: per process, run and run-queue wait as fractions
        of the wall time; the decoding engine's mean step time (ms) and steps per second."""
        (t_a, a, steps_a, ticks_a), (t_b, b, steps_b, ticks_b) = (
            self.marks[start],
            self.marks[end],
        )
        wall = t_b - t_a
        shares: dict[str, dict[str, float]] = {
            name: {
                "cpu": (b[name][0] - a[name][0]) / wall,
                "runqueue_wait": (b[name][1] - a[name][1]) / wall,
            }
            for name in a
        }
        num_steps = steps_b[1] - steps_a[1]
        shares["decode_engine"] = {
            "mean_step_ms": 1e3 * (steps_b[0] - steps_a[0]) / num_steps if num_steps else 0.0,
            "steps_per_s": num_steps / wall,
        }
        for core, after in ticks_b.items():
            delta = [x - y for x, y in zip(after, ticks_a[core], strict=True)]
            total = sum(delta) or 1
            # /proc/stat: user nice system idle iowait irq softirq steal ...
            shares[f"core{core}"] = {
                "busy": 1 - (delta[3] + delta[4]) / total,
                "steal": delta[7] / total,
            }
        return shares


def _core_ticks() -> dict[int, list[int]]:
    """Per core, /proc/stat's time counters (a VM's `steal` is time the host took away)."""
    ticks = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks[int(name[3:])] = [int(v) for v in values[:8]]
    return ticks


def _step_time_sum_count(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return (
        values["pdserve:engine_step_time_seconds_sum"],
        values["pdserve:engine_step_time_seconds_count"],
    )


def decode_url(mode: str, base_url: str) -> str:
    """The URL of the engine that decodes: the server, or a disagg router's decode worker."""
    if mode != "disagg":
        return base_url
    workers = httpx.get(f"{base_url}/workers", timeout=30).json()["workers"]
    return next(w["url"] for w in workers if w["role"] == "decode")


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds run and seconds waited on a run queue, summed over the process's threads."""
    run = wait = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # the thread exited
        run += int(fields[0]) / 1e9
        wait += int(fields[1]) / 1e9
    return run, wait


def serving_pids(mode: str, server_pid: int) -> dict[str, int]:
    """The engine processes: the server itself, or a disagg launcher's workers."""
    if mode != "disagg":
        return {"server": server_pid}
    pids = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"--role" in argv:
                pids[argv[argv.index(b"--role") + 1].decode()] = int(entry.name)
    return pids


async def drive(
    base_url: str,
    shorts: list[BenchRequest],
    long: BenchRequest,
    warmup: BenchRequest,
    lead_tokens: int,
    probe: CpuProbe,
) -> tuple[list[RequestRecord], float, str, list[RequestRecord]]:
    """The short streams, then the long request once they all stream; records, t0, the model
    and the warm-up's record (the detector's unloaded pace). `probe` is marked when the shorts
    start, when the long request is sent and when it ends."""
    endpoint = EndpointConfig(base_url=base_url, endpoint=CHAT_COMPLETIONS)
    # router_timing: the serving worker then reports its `pdserve_timing` (any mode).
    timed = EndpointConfig(
        base_url=base_url, endpoint=CHAT_COMPLETIONS, extra_body={"router_timing": {}}
    )
    async with make_http_client(endpoint) as http:
        model = (await probe_server(http, endpoint)).model
        warmups = await warm_up(http, endpoint, model, [warmup])
        records = [
            RequestRecord(i, "short", r.prompt_len, r.output_len, 0.0) for i, r in enumerate(shorts)
        ]
        t0 = time.perf_counter()
        probe.mark()
        tasks = [
            asyncio.create_task(send_request(http, endpoint, model, r, rec, t0))
            for r, rec in zip(shorts, records, strict=True)
        ]
        while min(len(r.token_times) for r in records) < lead_tokens:
            failed = [r.error for r in records if r.error]
            if failed or all(t.done() for t in tasks):
                raise BenchError(f"a short stream failed before the long request: {failed}")
            await asyncio.sleep(0.005)
        long_record = RequestRecord(
            len(shorts), "long", long.prompt_len, long.output_len, time.perf_counter() - t0
        )
        records.append(long_record)
        probe.mark()
        await send_request(http, timed, model, long, long_record, t0)
        probe.mark()
        await asyncio.gather(*tasks)
    errors = [r.error for r in records if r.error]
    if errors:
        raise BenchError(f"requests failed: {errors}")
    return records, t0, model, warmups


def split_gaps(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """The short streams' gaps (s): overlapping the long request's lifetime, and the baseline
    (all streams running, outside that lifetime)."""
    long = next(r for r in records if r.kind == "long")
    shorts = [r for r in records if r.kind == "short"]
    steady_from = max(r.token_times[1] for r in shorts)
    steady_until = min(r.token_times[-1] for r in shorts)
    during, baseline = [], []
    for record in shorts:
        for a, b in zip(record.token_times, record.token_times[1:], strict=False):
            if a < long.end_time and b > long.send_time:
                during.append(b - a)
            elif a >= steady_from and b <= steady_until:
                baseline.append(b - a)
    return during, baseline


def analyze(run: ModeRun, records: list[RequestRecord]) -> dict:
    during, baseline = split_gaps(records)
    during_ms, baseline_ms = Distribution.of_seconds(during), Distribution.of_seconds(baseline)
    long = next(r for r in records if r.kind == "long")
    timing = long.server_extra.get("pdserve_timing") or {}
    ratio = during_ms.p99 / baseline_ms.median if baseline_ms.median else float("inf")
    result = {
        "label": run.label,
        "mode": run.mode,
        "extra_args": list(run.extra_args),
        "itl_during_ms": asdict(during_ms),
        "itl_baseline_ms": asdict(baseline_ms),
        "num_gaps_during": len(during),
        "num_gaps_baseline": len(baseline),
        "p99_during_over_p50_baseline": ratio,
        "long_ttft_ms": long.ttft * 1e3,
        "long_prompt_tokens": long.num_prompt_tokens_reported,
        "long_lifetime_ms": (long.end_time - long.send_time) * 1e3,
        "timing": {k: timing[k] for k in TIMING_KEYS if k in timing},
    }
    if timing.get("kv_transfer_bytes") and long.num_prompt_tokens_reported:
        result["kv_bytes_per_token"] = timing["kv_transfer_bytes"] / long.num_prompt_tokens_reported
    if run.max_ratio is not None:
        result["target"] = f"p99 during <= {run.max_ratio:g}x p50 baseline"
        result["meets_target"] = ratio <= run.max_ratio
    if run.mode == "colocated" and timing.get("worker_prefill_ms"):
        result["max_gap_over_long_prefill"] = during_ms.max / timing["worker_prefill_ms"]
        result["shows_stall"] = result["max_gap_over_long_prefill"] >= MIN_STALL_FRACTION
    return result


def run_mode(run: ModeRun, scenario: Scenario, requests: tuple, out: Path) -> dict:
    shorts, long, warmup = requests
    launch = LaunchConfig(
        extra_args=run.extra_args, log_dir=out / "logs" / run.label, cwd=REPO_ROOT
    )
    print(
        f"[{run.label}] starting pdserve serve --mode {run.mode} {' '.join(run.extra_args)}",
        file=sys.stderr,
        flush=True,
    )
    with launch_server(launch, run.mode) as server:
        probe = CpuProbe(
            serving_pids(run.mode, server.process.pid), decode_url(run.mode, server.base_url)
        )
        load_before = os.getloadavg()[0]
        records, t0, model, warmups = asyncio.run(
            drive(server.base_url, shorts, long, warmup, scenario.lead_tokens, probe)
        )
        load_after = os.getloadavg()[0]
    spec = BenchSpec(
        EndpointConfig(base_url=server.base_url, endpoint=CHAT_COMPLETIONS),
        Workload(),
        interference=InterferenceConfig(long_prompt_tokens=scenario.long_prompt_tokens),
    )
    bench = summarize(run.label, model, spec, None, records, t0, warmups)
    plot_itl_timeline(bench, out / f"itl-{run.label}.png")
    result = analyze(run, records)
    result["interference_verdict"] = bench.interference.verdict
    # The machine is shared: the 1-minute load average says how much else was running, and
    # the engine processes' run-queue wait how much of it landed on their cores.
    result["loadavg_1m_before_after"] = [load_before, load_after]
    result["cpu_before_long"] = probe.shares(0, 1)
    result["cpu_during_long"] = probe.shares(1, 2)
    result["records"] = [r.to_dict() for r in records]
    return result


def build_requests(scenario: Scenario) -> tuple[list[BenchRequest], BenchRequest, BenchRequest]:
    synth = PromptSynthesizer(load_tokenizer(None))
    rng = seeded_rng(scenario.seed, 0)

    def request(num_tokens: int, output: int, kind: str) -> BenchRequest:
        return BenchRequest(synth.text(num_tokens, rng), num_tokens, output, kind)

    shorts = [
        request(scenario.short_prompt_tokens, scenario.short_output_tokens, "short")
        for _ in range(scenario.num_streams)
    ]
    long = request(scenario.long_prompt_tokens, scenario.long_output_tokens, "long")
    warmup = request(scenario.short_prompt_tokens, WARMUP_OUTPUT_LEN, "warmup")
    return shorts, long, warmup


# ---- raw KV transfer bandwidth --------------------------------------------------------------


def transfer_bandwidth(out: Path, repeats: int) -> dict:
    """benchmarks/kv_transfer.py on loopback (shm, tcp) and, when possible, across a veth."""
    script = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "kv_transfer.py"),
        "--repeats",
        str(repeats),
    ]
    report = {"loopback": _run_json(script, out / "kv_transfer_loopback.json")}
    sys.path.insert(0, str(REPO_ROOT))
    from tests.router.netns import netns_unavailable_reason, two_hosts

    reason = netns_unavailable_reason()
    if reason is not None:
        report["veth"] = {"skipped": reason}
        return report
    with two_hosts() as hosts:
        veth = [
            *script,
            "--transports",
            "tcp",
            "--sender-netns",
            hosts.ns_a,
            "--sender-host",
            hosts.addr_a,
        ]
        report["veth"] = _run_json(hosts.command(hosts.ns_b, veth), out / "kv_transfer_veth.json")
    return report


def _run_json(argv: list[str], path: Path) -> dict:
    subprocess.run(
        [*argv, "--json", str(path)], check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL
    )
    return json.loads(path.read_text())


# ---- report ---------------------------------------------------------------------------------


def print_report(results: list[dict], transfer: dict | None) -> None:
    header = (
        f"{'mode':<12} {'ITL base p50/p99/max ms':>24} {'ITL during p50/p99/max ms':>26} "
        f"{'p99/p50':>7} {'target':>7} {'long TTFT':>9} {'prefill':>8} {'KV ms':>6} "
        f"{'KV MB':>6} {'B/tok':>6} {'1st dec':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        base, during, t = r["itl_baseline_ms"], r["itl_during_ms"], r["timing"]
        prefill = t.get("prefill_ms") or t.get("worker_prefill_ms", 0.0)
        verdict = {True: "met", False: "MISSED", None: "-"}[r.get("meets_target")]
        print(
            f"{r['label']:<12} "
            f"{base['median']:>8.1f}/{base['p99']:>6.1f}/{base['max']:>7.1f} "
            f"{during['median']:>10.1f}/{during['p99']:>6.1f}/{during['max']:>7.1f} "
            f"{r['p99_during_over_p50_baseline']:>7.2f} {verdict:>7} "
            f"{r['long_ttft_ms']:>9.0f} {prefill:>8.0f} {t.get('kv_transfer_ms', 0):>6.1f} "
            f"{t.get('kv_transfer_bytes', 0) / 1e6:>6.1f} {r.get('kv_bytes_per_token', 0):>6.0f} "
            f"{t.get('first_decode_step_ms', 0):>7.1f}"
        )
    for r in results:
        load = "/".join(f"{x:.1f}" for x in r["loadavg_1m_before_after"])
        print(f"  {r['label']} (load avg {load}): {r['interference_verdict']}")
        before, during = r["cpu_before_long"], r["cpu_during_long"]
        for name in before:
            a, b = before[name], during[name]
            if name == "decode_engine":
                print(
                    f"    decoding engine: mean step {a['mean_step_ms']:.1f} -> "
                    f"{b['mean_step_ms']:.1f} ms, {a['steps_per_s']:.1f} -> "
                    f"{b['steps_per_s']:.1f} steps/s (before -> during the long request)"
                )
            elif name.startswith("core"):
                print(
                    f"    {name}: busy {a['busy']:.0%} -> {b['busy']:.0%}, "
                    f"stolen by the VM host {a['steal']:.0%} -> {b['steal']:.0%}"
                )
            else:
                print(
                    f"    {name} process: cpu {a['cpu']:.0%} -> {b['cpu']:.0%} of wall, "
                    f"waiting for a core {a['runqueue_wait']:.0%} -> "
                    f"{b['runqueue_wait']:.0%}"
                )
        if "shows_stall" in r:
            print(
                f"  colocated: max gap during = {r['max_gap_over_long_prefill']:.2f}x the long "
                f"prefill ({'stall shown' if r['shows_stall'] else 'NO stall'})"
            )
    chunked = [r for r in results if r["mode"] == "chunked"]
    if chunked:
        meeting = [r for r in chunked if r["meets_target"]]
        pick = max(meeting, key=lambda r: int(r["label"].split("-")[1]), default=None)
        print(
            f"  chunked budget meeting {CHUNKED_MAX_RATIO:g}x: "
            f"{pick['label'] if pick else 'none of ' + ', '.join(r['label'] for r in chunked)}"
        )
    if transfer is not None:
        print_transfer(transfer)


def print_transfer(transfer: dict) -> None:
    print("\nraw KV transfer (benchmarks/kv_transfer.py, median GB/s end to end):")
    for where in ("loopback", "veth"):
        report = transfer.get(where, {})
        if "skipped" in report:
            print(f"  {where}: skipped ({report['skipped']})")
            continue
        for row in report.get("results", []):
            ratio = f"  {row['vs_memcpy']:.2f}x memcpy" if "vs_memcpy" in row else ""
            print(
                f"  {where:<8} {row['case']:<32} {row['method']:<6} {row['blocks']:<10} "
                f"{row['gbytes_per_s_median']:6.2f} GB/s{ratio}"
            )
    shm = [r for r in transfer["loopback"]["results"] if r["method"] == "shm"]
    worst = min((r["vs_memcpy"] for r in shm), default=float("nan"))
    print(
        f"  shm >= {MIN_SHM_VS_MEMCPY:g}x memcpy: "
        f"{'met' if worst >= MIN_SHM_VS_MEMCPY else 'MISSED'} (worst case {worst:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("interference-results"))
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["colocated", "chunked", "disagg"],
        choices=["colocated", "chunked", "disagg"],
    )
    parser.add_argument("--chunk-budgets", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--lead-tokens", type=int, default=Scenario.lead_tokens)
    parser.add_argument("--transfer-repeats", type=int, default=5)
    parser.add_argument("--skip-transfer", action="store_true")
    args = parser.parse_args()
    scenario = Scenario(lead_tokens=args.lead_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    requests = build_requests(scenario)
    results = [
        run_mode(run, scenario, requests, args.out)
        for run in mode_runs(args.modes, args.chunk_budgets)
    ]
    transfer = None if args.skip_transfer else transfer_bandwidth(args.out, args.transfer_repeats)
    print_report(results, transfer)
    report = {
        "scenario": asdict(scenario),
        "cores": sorted(os.sched_getaffinity(0)),
        "modes": results,
        "transfer": transfer,
    }
    (args.out / "interference.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'interference.json'} and itl-*.png", file=sys.stderr)


if __name__ == "__main__":
    main()
