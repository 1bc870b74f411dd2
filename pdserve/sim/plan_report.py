"""What `pdserve plan` prints and draws: the ranked table, the reasoning, the split plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from statistics import fmean

from pdserve.core.config import Mode
from pdserve.sim.planner import ATTAINMENT_TARGET, Banded, Evaluation

_COLUMNS = (
    "#",
    "layout",
    "capacity/GPU",
    "goodput/GPU",
    "SLO met",
    "TTFT p50",
    "TTFT p99",
    "TPOT p99",
    "ITL p99",
    "binds",
)


def format_ranking(
    evaluations: Sequence[Evaluation],
    limit: int | None = None,
    bands: Sequence[Banded | None] = (),
) -> str:
    """The ranked table (capacity and goodput in req/s per GPU, latencies in ms); goodput
    and latencies at the planned rate, capacity for the finalists only. Where `bands` has a
    row's band, each latency shows it in parentheses (its value with every step ± the
    calibration's band)."""
    rows = []
    for i, e in enumerate(evaluations[:limit], start=1):
        band = bands[i - 1] if i <= len(bands) else None
        m = e.result.metrics
        rows.append(
            [
                str(i),
                e.label,
                _capacity(e),
                f"{e.goodput_per_gpu:.4f}",
                f"{e.attainment:.0%}",
                _with_band(m.ttft.median, band, "ttft", "median", "{:.0f}"),
                _with_band(m.ttft.p99, band, "ttft", "p99", "{:.0f}"),
                _with_band(m.tpot.p99, band, "tpot", "p99", "{:.1f}"),
                _with_band(m.itl.p99, band, "itl", "p99", "{:.1f}"),
                e.binding_slo(),
            ]
        )
    widths = [max(len(c) for c in column) for column in zip(_COLUMNS, *rows, strict=True)]

    def line(cells):
        return "  ".join(
            [
                cells[0].rjust(widths[0]),
                cells[1].ljust(widths[1]),
                *(c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)),
            ]
        )

    return "\n".join(line(cells) for cells in [list(_COLUMNS), *rows])


def _with_band(value: float, band: Banded | None, metric: str, stat: str, fmt: str) -> str:
    text = fmt.format(value)
    if band is None:
        return text
    low, high = (getattr(getattr(b.result.metrics, metric), stat) for b in (band.low, band.high))
    return f"{text} ({fmt.format(low)}–{fmt.format(high)})"


def _capacity(evaluation: Evaluation) -> str:
    per_gpu = evaluation.capacity_per_gpu
    return "-" if per_gpu is None else f"{per_gpu:.4f}"


def explain(best: Evaluation, evaluations: Sequence[Evaluation], band: Banded | None = None) -> str:
    """Why the recommendation: its margin (and the calibration band's range of it), which
    SLO binds, where its time goes."""
    lines = [
        f"Recommended: {best.label} — carries {_rate(best.capacity)} req/s "
        f"({_capacity(best)} per GPU) with >= {ATTAINMENT_TARGET:.0%} of requests within "
        f"the SLOs; at the planned rate {best.attainment:.0%} are."
    ]
    if band is not None and band.capacity is not None:
        slow, fast = band.capacity[1], band.capacity[0]
        lines.append(
            f"  within the calibration band it carries {_rate(slow)} to {_rate(fast)} req/s "
            "(every step slower, faster by the band)"
        )
    for mode in Mode:
        rival = next((e for e in evaluations if e.layout.mode is mode), None)
        if rival is not None and mode is not best.layout.mode:
            lines.append(
                f"  best {mode.value}: {rival.label}, carries {_rate(rival.capacity)}"
                f" req/s ({_capacity(rival)} per GPU), binds on {rival.binding_slo()}"
            )
    m = best.result.metrics
    binding = best.binding_slo()
    limit = best.slos[binding]
    lines.append(
        f"  binding SLO: {binding} (p99 {getattr(m, binding).p99:.0f} ms against {limit:.0f} ms)"
    )
    lines.append("  where TTFT goes: " + _ttft_breakdown(best))
    for name, pool in _pools(best).items():
        lines.append(f"  {name} pool: {pool}")
    return "\n".join(lines)


def _rate(rate: float | None) -> str:
    return "?" if rate is None else f"{rate:.3g}"


def _ttft_breakdown(evaluation: Evaluation) -> str:
    done = [r for r in evaluation.result.records if r.success]
    ttft = fmean(r.ttft for r in done) * 1000
    if evaluation.layout.mode is not Mode.DISAGG:
        return f"mean {ttft:.0f} ms (queueing and prefill on the serving worker)"
    remote = [r for r in done if "kv_transfer_ms" in r.server_extra]
    if not remote:
        return f"mean {ttft:.0f} ms, every prompt prefilled locally"
    prefill = fmean(r.server_extra["prefill_ms"] for r in remote)
    transfer = fmean(r.server_extra["kv_transfer_ms"] for r in remote)
    rest = fmean(r.ttft * 1000 for r in remote) - prefill - transfer
    return (
        f"mean {ttft:.0f} ms; remote prompts: prefill leg {prefill:.0f} ms (queue + "
        f"compute), KV transfer {transfer:.1f} ms, decode admission + first step "
        f"{rest:.0f} ms"
    )


def _pools(evaluation: Evaluation) -> dict[str, str]:
    out = {}
    sim = evaluation.sim
    for name, stats in sim.pool_stats.items():
        busy = sum(s.busy_s for s in stats) or 1.0
        parts = {
            part: sum(getattr(s, f"{part}_s") for s in stats) / busy
            for part in ("linear", "attention", "communication", "overhead")
        }
        utilization = busy / (sim.duration_s * len(stats)) if sim.duration_s else 0.0
        out[name] = f"{utilization:.0%} busy; of busy time " + ", ".join(
            f"{part} {share:.0%}" for part, share in parts.items()
        )
    return out


def plot_goodput_vs_split(evaluations: Sequence[Evaluation], path: Path) -> Path:
    """Goodput per GPU against the prefill share of GPUs (disagg), one line per TP, with
    the best colocated and chunked layouts as reference lines."""
    # matplotlib takes about a second to import: only a plan that plots pays for it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    disagg = [
        e
        for e in evaluations
        if e.layout.mode is Mode.DISAGG and not e.layout.local_prefill_threshold
    ]
    for tp in sorted({e.layout.tp for e in disagg}):
        points = sorted((_prefill_share(e), e.goodput_per_gpu) for e in disagg if e.layout.tp == tp)
        ax.plot(*zip(*points, strict=True), marker="o", label=f"disagg TP{tp}")
    for mode, style in ((Mode.COLOCATED, ":"), (Mode.CHUNKED, "--")):
        best = next((e for e in evaluations if e.layout.mode is mode), None)
        if best is not None:
            ax.axhline(best.goodput_per_gpu, ls=style, color="k", lw=1, label=f"best {best.label}")
    rate = evaluations[0].result.request_rate
    ax.set(
        xlabel="share of GPUs in prefill workers",
        ylabel="goodput per GPU (req/s)",
        title=f"Goodput at the planned rate ({rate or 'trace pace'} req/s) against the "
        "prefill:decode split",
    )
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _prefill_share(evaluation: Evaluation) -> float:
    config = evaluation.sim.config
    return config.prefill_pool.num_devices / config.num_devices
