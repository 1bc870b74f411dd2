"""What `pdserve plan` prints and draws: the ranked table, the reasoning, the split plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from statistics import fmean

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdserve.sim.config import Mode
from pdserve.sim.planner import ATTAINMENT_TARGET, Evaluation

_COLUMNS = ("#", "layout", "goodput/GPU", "goodput", "SLO met", "TTFT p50", "TTFT p99",
            "TPOT p99", "ITL p99", "binds")


def format_ranking(evaluations: Sequence[Evaluation], limit: int | None = None) -> str:
    """The ranked table (goodput in req/s, latencies in ms)."""
    rows = [[str(i), e.label, f"{e.goodput_per_gpu:.4f}", f"{e.goodput:.3f}",
             f"{e.attainment:.0%}", f"{e.result.metrics.ttft.median:.0f}",
             f"{e.result.metrics.ttft.p99:.0f}", f"{e.result.metrics.tpot.p99:.1f}",
             f"{e.result.metrics.itl.p99:.1f}", e.binding_slo()]
            for i, e in enumerate(evaluations[:limit], start=1)]
    widths = [max(len(c) for c in column) for column in zip(_COLUMNS, *rows, strict=True)]

    def line(cells):
        return "  ".join([cells[0].rjust(widths[0]), cells[1].ljust(widths[1]),
                          *(c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True))])

    return "\n".join(line(cells) for cells in [list(_COLUMNS), *rows])


def explain(best: Evaluation, evaluations: Sequence[Evaluation]) -> str:
    """Why the recommendation: its margin, which SLO binds, where its time goes."""
    lines = [f"Recommended: {best.label} — {best.goodput_per_gpu:.4f} req/s per GPU, "
             f"{best.attainment:.0%} of requests within the SLOs"
             f"{'' if best.carries_load else f' (below the {ATTAINMENT_TARGET:.0%} target)'}."]
    for mode in Mode:
        rival = next((e for e in evaluations if e.layout.mode is mode and e is not best), None)
        if rival is not None and rival.layout.mode is not best.layout.mode:
            lines.append(f"  best {mode.value}: {rival.label}, {rival.goodput_per_gpu:.4f} "
                         f"req/s per GPU ({rival.attainment:.0%} within SLOs, binds on "
                         f"{rival.binding_slo()})")
    m = best.result.metrics
    binding = best.binding_slo()
    limit = best.slos[binding]
    lines.append(f"  binding SLO: {binding} (p99 {getattr(m, binding).p99:.0f} ms against "
                 f"{limit:.0f} ms)")
    lines.append("  where TTFT goes: " + _ttft_breakdown(best))
    for name, pool in _pools(best).items():
        lines.append(f"  {name} pool: {pool}")
    return "\n".join(lines)


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
    return (f"mean {ttft:.0f} ms; remote prompts: prefill leg {prefill:.0f} ms (queue + "
            f"compute), KV transfer {transfer:.1f} ms, decode admission + first step "
            f"{rest:.0f} ms")


def _pools(evaluation: Evaluation) -> dict[str, str]:
    out = {}
    sim = evaluation.sim
    for name, stats in sim.pool_stats.items():
        busy = sum(s.busy_s for s in stats) or 1.0
        parts = {part: sum(getattr(s, f"{part}_s") for s in stats) / busy
                 for part in ("linear", "attention", "communication", "overhead")}
        utilization = busy / (sim.duration_s * len(stats)) if sim.duration_s else 0.0
        out[name] = (f"{utilization:.0%} busy; of busy time " +
                     ", ".join(f"{part} {share:.0%}" for part, share in parts.items()))
    return out


def plot_goodput_vs_split(evaluations: Sequence[Evaluation], path: Path) -> Path:
    """Goodput per GPU against the prefill share of GPUs (disagg), one line per TP, with
    the best colocated and chunked layouts as reference lines."""
    figure = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    disagg = [e for e in evaluations if e.layout.mode is Mode.DISAGG
              and not e.layout.local_prefill_threshold]
    for tp in sorted({e.layout.tp for e in disagg}):
        points = sorted((_prefill_share(e), e.goodput_per_gpu) for e in disagg
                        if e.layout.tp == tp)
        ax.plot(*zip(*points, strict=True), marker="o", label=f"disagg TP{tp}")
    for mode, style in ((Mode.COLOCATED, ":"), (Mode.CHUNKED, "--")):
        best = next((e for e in evaluations if e.layout.mode is mode), None)
        if best is not None:
            ax.axhline(best.goodput_per_gpu, ls=style, color="k", lw=1,
                       label=f"best {best.label}")
    ax.set(xlabel="share of GPUs in prefill workers", ylabel="goodput per GPU (req/s)",
           title="Goodput against the prefill:decode split")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _prefill_share(evaluation: Evaluation) -> float:
    config = evaluation.sim.config
    return config.prefill_pool.num_devices / config.num_devices
