"""The comparison table both `bench compare` and `simulate` print: one `CompareRow` per
server or simulated mode (latencies in ms), `format_table` plain or Markdown, and `Layout`,
what a row ran on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.workload.errors import BenchError
from pdserve.workload.run import BenchResult


class SearchOutcome(Protocol):
    """What a row shows of a search for the highest rate meeting the SLOs (`bench.search`'s
    `SearchResult`)."""

    @property
    def max_rate(self) -> float | None: ...

    @property
    def min_missed_rate(self) -> float | None: ...

    @property
    def num_seeds(self) -> int: ...


@dataclass(frozen=True)
class Layout:
    """What one row ran on: `num_engines` engine processes on `num_cores` cores (None: not
    declared), `description` for the table, `argv` the launched server's flags for it."""

    num_engines: int | None
    num_cores: int | None
    description: str
    argv: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "num_engines": self.num_engines,
            "num_cores": self.num_cores,
            "layout": self.description,
        }


@dataclass(frozen=True)
class CompareRow:
    """One server's line of the table (latencies in ms). `error` is set when it never ran.
    `max_rate` is the highest searched rate meeting the SLOs (None: none did, or, when
    `is_searched` is False, no search ran); with `min_missed_rate` the interval the highest
    rate lies in; `finding` is the detector's ("interference", "overload", "both",
    "neither"); `layout`, `num_engines`, `num_cores` what it ran on (None: not declared)."""

    name: str
    completed: int = 0
    failed: int = 0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    itl_p50: float = 0.0
    itl_p99: float = 0.0
    itl_max: float = 0.0
    tpot_p99: float = 0.0
    output_throughput: float = 0.0
    goodput: float | None = None
    num_good: int | None = None
    attainment: float | None = None
    is_searched: bool = False
    max_rate: float | None = None
    min_missed_rate: float | None = None
    spike_fraction: float = 0.0
    in_prefill_fraction: float = 0.0
    prefill_slowdown: float = 0.0
    is_interference: bool = False
    overload_slowdown: float = 0.0
    is_overload: bool = False
    finding: str = ""
    verdict: str = ""
    layout: str = ""
    num_engines: int | None = None
    num_cores: int | None = None
    num_seeds: int = 1
    error: str | None = None

    @classmethod
    def of(
        cls,
        name: str,
        result: BenchResult,
        search: SearchOutcome | None = None,
        layout: Layout | None = None,
    ) -> CompareRow:
        m, report = result.metrics, result.interference
        return cls(
            name=name,
            **resources_of(layout),
            completed=m.completed,
            failed=m.failed,
            ttft_p50=m.ttft.median,
            ttft_p99=m.ttft.p99,
            itl_p50=m.itl.median,
            itl_p99=m.itl.p99,
            itl_max=m.itl.max,
            tpot_p99=m.tpot.p99,
            output_throughput=m.output_throughput,
            goodput=m.request_goodput,
            num_good=m.num_good,
            attainment=m.slo_attainment,
            is_searched=search is not None,
            max_rate=None if search is None else search.max_rate,
            min_missed_rate=None if search is None else search.min_missed_rate,
            spike_fraction=report.spike_fraction,
            in_prefill_fraction=report.in_prefill_fraction,
            prefill_slowdown=report.prefill_slowdown,
            is_interference=report.is_interference,
            overload_slowdown=report.overload.slowdown,
            is_overload=report.is_overload,
            finding=report.finding,
            verdict=report.verdict,
            num_seeds=1 if search is None else search.num_seeds,
        )

    @property
    def goodput_per_core(self) -> float | None:
        """The highest rate meeting the SLOs (else the goodput at the offered rate) per core."""
        best = self.max_rate if self.is_searched else self.goodput
        return None if best is None or not self.num_cores else best / self.num_cores

    @classmethod
    def from_saved(cls, name: str, run: dict, layout: Layout | None = None) -> CompareRow:
        """A row from the numbers of a saved run without per-request records (e.g. another
        tool's result file); pdserve's files are judged again from their records instead."""
        interference = run.get("pdserve", {}).get("interference", {})
        try:
            return cls(
                name=name,
                **resources_of(layout),
                completed=run["completed"],
                failed=run.get("failed", 0),
                ttft_p50=run["median_ttft_ms"],
                ttft_p99=run["p99_ttft_ms"],
                itl_p50=run["median_itl_ms"],
                itl_p99=run["p99_itl_ms"],
                itl_max=run["max_itl_ms"],
                tpot_p99=run["p99_tpot_ms"],
                output_throughput=run["output_throughput"],
                goodput=run.get("request_goodput"),
                spike_fraction=interference.get("spike_fraction", 0.0),
                in_prefill_fraction=interference.get("in_prefill_fraction", 0.0),
                is_interference=interference.get("is_interference", False),
                verdict=interference.get("verdict", ""),
            )
        except (KeyError, TypeError) as exc:
            raise BenchError(f"--saved {name}: not a saved benchmark run (missing {exc})") from None


def resources_of(layout: Layout | None) -> dict:
    if layout is None:
        return {}
    return {
        "layout": layout.description,
        "num_engines": layout.num_engines,
        "num_cores": layout.num_cores,
    }


def interval_text(row: CompareRow) -> str:
    """The interval a searched row's highest rate lies in, e.g. "0.5-0.71", ">=0.5",
    "none (<0.1)"."""
    if not row.is_searched:
        return "-"
    low, high = row.max_rate, row.min_missed_rate
    if low is None:
        return "none" if high is None else f"none (<{high:.3g})"
    return f">={low:.3g}" if high is None else f"{low:.3g}-{high:.3g}"


_COLUMNS = (
    ("mode", "{r.name}"),
    ("layout", "{r.layout}"),
    ("cores", "{cores}"),
    ("ok", "{r.completed}/{total}"),
    ("TTFT p50", "{r.ttft_p50:.0f}"),
    ("TTFT p99", "{r.ttft_p99:.0f}"),
    ("ITL p50", "{r.itl_p50:.1f}"),
    ("ITL p99", "{r.itl_p99:.1f}"),
    ("ITL max", "{r.itl_max:.0f}"),
    ("TPOT p99", "{r.tpot_p99:.1f}"),
    ("out tok/s", "{r.output_throughput:.1f}"),
    ("goodput", "{goodput}"),
    ("SLO met", "{attainment}"),
    ("max rate", "{max_rate}"),
    ("per core", "{per_core}"),
    ("in prefill", "{r.in_prefill_fraction:.0%}"),
    ("finding", "{r.finding}"),
)


def format_table(rows: list[CompareRow], markdown: bool = False) -> str:
    """The comparison table (latencies in ms, goodput and max rate in req/s), plain or
    Markdown."""
    header = [name for name, _ in _COLUMNS]
    body = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    return "\n".join(_aligned(cells, widths) for cells in [header, *body])


def _aligned(cells: list[str], widths: list[int]) -> str:
    # The name column reads left to right; numbers line up on the right.
    first = cells[0].ljust(widths[0])
    return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])


def _cells(row: CompareRow) -> list[str]:
    cores = "?" if row.num_cores is None else str(row.num_cores)
    if row.error is not None:
        return [row.name, row.layout, cores, "failed", *(["-"] * (len(_COLUMNS) - 4))]
    per_core = row.goodput_per_core
    values = {
        "total": row.completed + row.failed,
        "cores": cores,
        "goodput": "-" if row.goodput is None else f"{row.goodput:.3f}",
        "attainment": "-" if row.attainment is None else f"{row.attainment:.0%}",
        "max_rate": interval_text(row),
        "per_core": "-" if per_core is None else f"{per_core:.3g}",
    }
    return [fmt.format(r=row, **values) for _, fmt in _COLUMNS]
