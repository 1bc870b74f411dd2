"""`bench compare`: the same workload and seed against each serving mode, side by side."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pdserve.bench.benchmark import (
    BenchResult,
    BenchSpec,
    WorkloadPlan,
    context_cap,
    plan_workload,
    probe,
    run_plan,
)
from pdserve.bench.errors import BenchError
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.bench.report import write_report
from pdserve.bench.results import result_to_dict
from pdserve.bench.tokenizer import TokenizerLike, load_tokenizer

DEFAULT_MODES = ("colocated", "chunked", "disagg")
# Without SLOs, modes within this share of the best output throughput compete on ITL p99.
_THROUGHPUT_TOLERANCE = 0.9


@dataclass(frozen=True)
class CompareSpec:
    """Modes to launch in turn (with `launch`), plus already-running servers as
    (name, base URL) rows; `bench` is the workload and load applied to every one of them
    (its endpoint's base URL is replaced per server)."""

    bench: BenchSpec
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    modes: tuple[str, ...] = DEFAULT_MODES
    externals: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if len(self.bench.request_rates) != 1:
            raise BenchError("bench compare takes one --request-rate, not a sweep")
        names = [*self.modes, *(name for name, _ in self.externals)]
        if not names:
            raise BenchError("bench compare: nothing to compare; give --modes or --external")
        if len(set(names)) != len(names):
            raise BenchError(f"bench compare: row names must be unique, got {names}")
        for mode in self.launch.mode_args:
            if mode not in self.modes:
                raise BenchError(f"--mode-args: {mode!r} is not one of --modes {self.modes}")


@dataclass(frozen=True)
class CompareRow:
    """One server's line of the table (latencies in ms). `error` is set when it never ran."""

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
    spike_fraction: float = 0.0
    in_prefill_fraction: float = 0.0
    is_interference: bool = False
    verdict: str = ""
    error: str | None = None

    @classmethod
    def of(cls, name: str, result: BenchResult) -> CompareRow:
        m, report = result.metrics, result.interference
        return cls(
            name=name,
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
            spike_fraction=report.spike_fraction,
            in_prefill_fraction=report.in_prefill_fraction,
            is_interference=report.is_interference,
            verdict=report.verdict,
        )

    @classmethod
    def from_saved(cls, name: str, run: dict) -> CompareRow:
        """A row from a saved run (`--save-result` JSON of `bench` or `simulate`)."""
        interference = run.get("pdserve", {}).get("interference", {})
        try:
            return cls(
                name=name,
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


def load_saved_rows(name: str, path: str | Path) -> list[CompareRow]:
    """Rows from a saved result: one run, or every run of a `compare`/`simulate` file
    (named NAME/MODE)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"--saved {name}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or "sweep" in data:
        raise BenchError(f"--saved {name}: {path} holds a sweep or no run; save one rate")
    if isinstance(data.get("runs"), dict):
        return [CompareRow.from_saved(f"{name}/{mode}", run) for mode, run in data["runs"].items()]
    return [CompareRow.from_saved(name, data)]


@dataclass(frozen=True)
class Recommendation:
    name: str
    reason: str

    def __str__(self) -> str:
        return f"Recommendation: {self.name} — {self.reason}."


@dataclass
class CompareResult:
    spec: CompareSpec
    results: dict[str, BenchResult]
    rows: list[CompareRow]
    recommendation: Recommendation | None

    def to_dict(self) -> dict:
        bench = self.spec.bench
        # Each run records its own server's URL; the shared config has none.
        shared = {k: v for k, v in bench.describe().items() if k != "base_url"}
        return {
            "config": {
                **shared,
                "request_rate": bench.request_rates[0],
                "modes": list(self.spec.modes),
                "externals": dict(self.spec.externals),
                "server_command": [*self.spec.launch.command, *self.spec.launch.extra_args],
                "mode_args": {m: list(a) for m, a in self.spec.launch.mode_args.items()},
            },
            "rows": [asdict(r) for r in self.rows],
            "recommendation": None if self.recommendation is None else asdict(self.recommendation),
            "runs": {name: result_to_dict(r) for name, r in self.results.items()},
        }


def run_compare(spec: CompareSpec, tokenizer: TokenizerLike | None = None) -> CompareResult:
    """Launch each mode in turn, run the workload, stop it; then the externals.

    The workload is built once (fitted to the first server's context) so every row sees the
    same requests at the same times. A server that fails to start becomes a row with its
    error; the comparison goes on.
    """
    runner = _Runner(spec, tokenizer)
    for mode in spec.modes:
        try:
            with launch_server(spec.launch, mode) as server:
                runner.run(mode, server.base_url)
        except BenchError as exc:
            runner.fail(mode, str(exc))
    for name, url in spec.externals:
        try:
            runner.run(name, url)
        except BenchError as exc:
            runner.fail(name, str(exc))
    if not runner.results:
        details = "; ".join(f"{r.name}: {r.error}" for r in runner.rows)
        raise BenchError(f"bench compare: no server completed a run ({details})")
    has_slos = bool(spec.bench.slos)
    return CompareResult(spec, runner.results, runner.rows, recommend(runner.rows, has_slos))


class _Runner:
    """Runs the shared plan against one server after another."""

    def __init__(self, spec: CompareSpec, tokenizer: TokenizerLike | None) -> None:
        self._spec = spec
        self._tokenizer = tokenizer
        self._plan: WorkloadPlan | None = None
        self.results: dict[str, BenchResult] = {}
        self.rows: list[CompareRow] = []

    def run(self, name: str, base_url: str) -> None:
        endpoint = replace(self._spec.bench.endpoint, base_url=base_url)
        bench = replace(self._spec.bench, endpoint=endpoint)
        server = asyncio.run(probe(bench))
        if self._plan is None:
            tokenizer = self._tokenizer or load_tokenizer(None)
            self._plan = plan_workload(
                bench.workload, tokenizer, bench.seed, context_cap(bench, server)
            )
        [result] = asyncio.run(run_plan(bench, self._plan, server, label=name))
        self.results[name] = result
        self.rows.append(CompareRow.of(name, result))

    def fail(self, name: str, error: str) -> None:
        self.rows.append(CompareRow(name, error=error))


def recommend(rows: list[CompareRow], has_slos: bool) -> Recommendation | None:
    """Pick a mode and say why: highest goodput under the SLOs when given; otherwise the
    lowest ITL p99 among rows with the fewest failures and near-best output throughput."""
    ran = [r for r in rows if r.error is None and r.completed > 0]
    if not ran:
        return None
    if has_slos:
        best = max(ran, key=lambda r: (r.goodput or 0.0, -r.itl_p99))
        others = _versus(ran, best, lambda r: f"{r.goodput or 0.0:.3f}")
        reason = f"highest goodput under the SLOs, {best.goodput or 0.0:.3f} req/s{others}"
    else:
        fewest_failed = min(r.failed for r in ran)
        top = max(r.output_throughput for r in ran if r.failed == fewest_failed)
        eligible = [
            r
            for r in ran
            if r.failed == fewest_failed and r.output_throughput >= _THROUGHPUT_TOLERANCE * top
        ]
        best = min(eligible, key=lambda r: r.itl_p99)
        others = _versus(ran, best, lambda r: f"{r.itl_p99:.0f} ms")
        reason = (
            f"lowest ITL p99, {best.itl_p99:.0f} ms{others}, at "
            f"{best.output_throughput / top:.0%} of the best output throughput (no --goodput "
            "SLOs given)"
        )
    interfering = [r for r in ran if r.is_interference and r is not best]
    if interfering:
        names = ", ".join(
            f"{r.name} ({r.in_prefill_fraction:.0%} of its stalled time during long prefills)"
            for r in interfering
        )
        reason += f"; phase interference in {names}"
    return Recommendation(best.name, reason)


def _versus(rows: list[CompareRow], best: CompareRow, value) -> str:
    others = [f"{r.name} {value(r)}" for r in rows if r is not best]
    return f" (vs {', '.join(others)})" if others else ""


_COLUMNS = (
    ("mode", "{r.name}"),
    ("ok", "{r.completed}/{total}"),
    ("TTFT p50", "{r.ttft_p50:.0f}"),
    ("TTFT p99", "{r.ttft_p99:.0f}"),
    ("ITL p50", "{r.itl_p50:.1f}"),
    ("ITL p99", "{r.itl_p99:.1f}"),
    ("ITL max", "{r.itl_max:.0f}"),
    ("TPOT p99", "{r.tpot_p99:.1f}"),
    ("out tok/s", "{r.output_throughput:.1f}"),
    ("goodput", "{goodput}"),
    ("spikes", "{r.spike_fraction:.1%}"),
    ("in prefill", "{r.in_prefill_fraction:.0%}"),
)


def format_table(rows: list[CompareRow], markdown: bool = False) -> str:
    """The comparison table (latencies in ms, goodput in req/s), plain or Markdown."""
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
    if row.error is not None:
        return [row.name, "failed", *(["-"] * (len(_COLUMNS) - 2))]
    total = row.completed + row.failed
    goodput = "-" if row.goodput is None else f"{row.goodput:.3f}"
    return [fmt.format(r=row, total=total, goodput=goodput) for _, fmt in _COLUMNS]


def save_compare(result: CompareResult, out_dir: str | Path, json_path: str | Path | None = None):
    """Write the combined JSON (default `out_dir/compare.json`) and the report; their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_file = Path(json_path) if json_path else out / "compare.json"
    json_file.write_text(json.dumps(result.to_dict(), indent=1))
    preamble = "\n".join(
        [
            "## Comparison",
            "",
            "Latencies in ms, goodput in req/s; *spikes*: share of token gaps above "
            f"{result.spec.bench.interference.spike_factor:g}× the run's median ITL; "
            "*in prefill*: share of those spikes during a long prompt's prefill.",
            "",
            format_table(result.rows, markdown=True),
            "",
            f"**{result.recommendation}**" if result.recommendation else "",
            *[f"- {r.name}: failed to run: {r.error}" for r in result.rows if r.error],
        ]
    )
    report = write_report(list(result.results.values()), out, "pdserve bench compare", preamble)
    return json_file, report
