"""PNG plots with matplotlib's Agg canvas (no display, no global pyplot state)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from pdserve.workload.run import BenchResult

_DPI = 110


def _figure(width: float = 9.0, height: float = 4.5) -> Figure:
    figure = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _log_scale(ax, which: str) -> None:
    """Log scale on axis `which` ("x" or "y"), plain-number labels on major ticks only."""
    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    # Ticks at 1-2-5 steps when latencies span a couple of decades, else one per decade
    # (token pairs sent in the same step put gaps near 0.01 ms). Call after plotting.
    low, high = axis.get_view_interval()
    is_narrow = low > 0 and math.log10(high / low) <= 2.5
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if is_narrow else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_itl_timeline(result: BenchResult, path: Path) -> Path:
    """Every stream's token gaps over time, long prompts' prefill windows shaded."""
    figure = _figure()
    ax = figure.add_subplot()
    for window in result.interference.windows:
        ax.axvspan(window.start, window.end, color="tab:red", alpha=0.12, lw=0)
    kinds = sorted({r.kind for r in result.records})
    colors = {k: f"C{i % 10}" for i, k in enumerate(kinds)}
    for r in result.records:
        if len(r.token_times) > 1:
            # Each gap drawn flat over the interval it spans, so a stall reads as a plateau.
            t = np.asarray(r.token_times)
            gaps = np.diff(t) * 1000.0
            ax.step(t, np.r_[gaps[0], gaps], where="pre", lw=0.7, alpha=0.8, color=colors[r.kind])
    for kind in kinds:
        ax.plot([], [], color=colors[kind], label=kind)
    if result.interference.windows:
        ax.fill_between([], [], color="tab:red", alpha=0.12, label="long-prompt prefill")
    report = result.interference
    threshold = report.spike_threshold_ms
    if threshold > 0:
        label = f"stall: > {report.config.spike_factor:g}× its stream's pace (~{threshold:.0f} ms)"
        ax.axhline(threshold, color="k", ls="--", lw=0.8, label=label)
        _log_scale(ax, "y")
    ax.set(xlabel="time since start (s)", ylabel="inter-token latency (ms)")
    ax.set_title(f"ITL over time, every stream — {result.label}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    figure.savefig(path)
    return path


def plot_cdfs(series: Mapping[str, Sequence[float]], xlabel: str, title: str, path: Path) -> Path:
    """Empirical CDFs of several runs' values, overlaid (log x axis)."""
    figure = _figure(7.0, 4.5)
    ax = figure.add_subplot()
    for name, values in series.items():
        if len(values):
            x = np.sort(np.asarray(values, dtype=float))
            y = np.arange(1, len(x) + 1) / len(x)
            ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post", label=name)
    ax.set(xlabel=xlabel, ylabel="fraction of samples", ylim=(0, 1.02))
    _log_scale(ax, "x")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    figure.savefig(path)
    return path


def plot_goodput_vs_rate(
    rates: Sequence[float], goodputs: Sequence[float], ylabel: str, path: Path
) -> Path:
    """Goodput (or throughput, without SLOs) against offered request rate."""
    figure = _figure(6.0, 4.0)
    ax = figure.add_subplot()
    ax.plot(rates, goodputs, marker="o", label="measured")
    top = max(rates)
    ax.plot([0, top], [0, top], ls=":", color="gray", label="offered rate")
    ax.set(xlabel="request rate (req/s)", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figure.savefig(path)
    return path


def plot_attainment(
    curves: Mapping[str, Sequence[tuple[float, float, bool]]], target: float, path: Path
) -> Path:
    """Each server's share of requests meeting every SLO against the searched rate; points
    are (rate, share, stopped early), a run stopped early drawn as a downward triangle (its
    share is at most that)."""
    figure = _figure(6.5, 4.0)
    ax = figure.add_subplot()
    for i, (name, points) in enumerate(curves.items()):
        ordered = sorted(points)
        color = f"C{i % 10}"
        rates = [rate for rate, _, _ in ordered]
        ax.plot(rates, [share * 100 for _, share, _ in ordered], color=color, label=name)
        for rate, share, is_stopped in ordered:
            ax.plot(rate, share * 100, marker="v" if is_stopped else "o", color=color)
    ax.axhline(target * 100, color="k", ls="--", lw=0.8, label=f"target {target:.0%}")
    ax.set(xlabel="request rate (req/s)", ylabel="requests meeting every SLO (%)")
    ax.set_ylim(0, 102)
    _log_scale(ax, "x")
    ax.grid(alpha=0.3)
    ax.set_title("SLO attainment against request rate", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    figure.savefig(path)
    return path
