"""`--report DIR`: report.md and its PNG plots, for one run, a rate sweep, or a comparison."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.workload.metrics import LATENCY_METRICS
from pdserve.workload.records import RequestRecord
from pdserve.workload.results import rate_text
from pdserve.workload.run import BenchResult


def write_report(
    results: Sequence[BenchResult], out_dir: str | Path, title: str, preamble: str = ""
) -> Path:
    """Write `out_dir/report.md` with plots beside it; return the report's path.

    Every run gets its ITL timeline; TTFT and ITL CDFs overlay all runs; a goodput-vs-rate
    plot is added when the runs are a sweep over finite rates.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", ""]
    if preamble:
        lines += [preamble, ""]
    lines += _overview_plots(results, out)
    for result in results:
        lines += _run_section(result, out)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plots():
    # matplotlib takes about a second to import: only reports pay for it, not every CLI start.
    from pdserve.workload import plots

    return plots


def _overview_plots(results: Sequence[BenchResult], out: Path) -> list[str]:
    ttfts = {r.label: [x.ttft * 1000 for x in r.records if x.success] for r in results}
    itls = {r.label: [g * 1000 for x in r.records if x.success for g in x.itls] for r in results}
    _plots().plot_cdfs(ttfts, "TTFT (ms)", "CDF of time to first token", out / "ttft_cdf.png")
    _plots().plot_cdfs(itls, "ITL (ms)", "CDF of inter-token latency", out / "itl_cdf.png")
    lines = ["## Latency distributions", "", "![TTFT CDF](ttft_cdf.png)", "![ITL CDF](itl_cdf.png)"]
    if _is_sweep(results):
        lines += ["", *_sweep_section(results, out)]
    return [*lines, ""]


def _is_sweep(results: Sequence[BenchResult]) -> bool:
    """Several runs, each at its own finite rate."""
    rates = {r.request_rate for r in results}
    finite = all(rate is not None and math.isfinite(rate) for rate in rates)
    return finite and len(results) >= 2 and len(rates) == len(results)


def _sweep_section(results: Sequence[BenchResult], out: Path) -> list[str]:
    has_slos = results[0].metrics.request_goodput is not None
    rates = [r.request_rate for r in results]
    ys = [r.metrics.request_goodput if has_slos else r.metrics.request_throughput for r in results]
    ylabel = "goodput (req/s)" if has_slos else "throughput (req/s, no SLOs given)"
    _plots().plot_goodput_vs_rate(rates, ys, ylabel, out / "goodput_vs_rate.png")
    rows = [
        "## Rate sweep",
        "",
        "| rate (req/s) | completed | req/s | goodput (req/s) | output tok/s | TTFT p99 (ms) "
        "| ITL p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.metrics
        goodput = "-" if m.request_goodput is None else f"{m.request_goodput:.3f}"
        rows.append(
            f"| {rate_text(r.request_rate)} | {m.completed} | {m.request_throughput:.3f} | "
            f"{goodput} | {m.output_throughput:.1f} | {m.ttft.p99:.1f} | {m.itl.p99:.1f} |"
        )
    return [*rows, "", "![goodput vs rate](goodput_vs_rate.png)"]


def _run_section(result: BenchResult, out: Path) -> list[str]:
    m = result.metrics
    timeline = f"itl_timeline-{_slug(result.label)}.png"
    _plots().plot_itl_timeline(result, out / timeline)
    goodput = "-" if m.request_goodput is None else f"{m.request_goodput:.3f} req/s"
    lines = [
        f"## {result.label}",
        "",
        f"- model `{result.model}`, workload `{result.spec.workload.name}`, request rate "
        f"{rate_text(result.request_rate)}, seed {result.spec.seed}",
        f"- completed {m.completed}, failed {m.failed}, duration {m.duration:.2f} s",
        f"- {m.request_throughput:.3f} req/s, {m.output_throughput:.1f} output tok/s, "
        f"{m.total_token_throughput:.1f} total tok/s, goodput {goodput}",
        f"- **{result.interference.verdict}**",
        "",
        "| ms | mean | median | p90 | p99 | max | std |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in LATENCY_METRICS:
        d = getattr(m, name)
        values = (d.mean, d.median, d.p90, d.p99, d.max, d.std)
        lines.append(f"| {name.upper()} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    lines += ["", *_breakdown_table(result.records), f"![ITL timeline]({timeline})", ""]
    return lines


def server_breakdown(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Numbers the server reported per request beyond usage counts, e.g. a TTFT breakdown:
    numeric fields of `server_extra`, one level of nesting flattened to "key.field"."""
    series: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.server_extra.items():
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, v in items:
                if isinstance(v, int | float) and not isinstance(v, bool):
                    series.setdefault(key if sub is None else f"{key}.{sub}", []).append(v)
    return series


def _breakdown_table(records: Sequence[RequestRecord]) -> list[str]:
    series = server_breakdown(records)
    if not series:
        return []
    lines = [
        "Server-reported timing (per request):",
        "",
        "| field | mean | median | p99 |",
        "|---|---|---|---|",
    ]
    for name, values in sorted(series.items()):
        v = np.asarray(values, dtype=float)
        lines.append(
            f"| {name} | {v.mean():.2f} | {np.median(v):.2f} | {np.percentile(v, 99):.2f} |"
        )
    return [*lines, ""]


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-") or "run"
