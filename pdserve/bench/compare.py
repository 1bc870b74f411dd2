"""`bench compare`: the same workload and seed against each serving mode, side by side, on
the same cores (`layout.py`: colocated and chunked as replicas, disagg as P + D workers).

Each server gets its warm-ups, then the run at the offered rate (the table's row), then,
with `search`, a short search for the highest rate at which the target share of requests
meets every SLO (`search.py`: goodput as DistServe defines it), on the same server, then
with `num_seeds` > 1 the runs that decide it (the highest rate met and the lowest missed)
again with other seeds: a rate counts as met only where every seed met it, as missed only
where every seed missed it, so each mode's answer is an interval, and a winner is named only
where the intervals separate. Saved runs join as rows judged from their records exactly like
measured ones. Only rows on the comparison's cores are ranked.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from pdserve.bench.benchmark import context_cap, probe, rate_label, run_rate
from pdserve.bench.client import make_http_client
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.bench.layout import mode_layout, parse_external, resolve_cores
from pdserve.bench.runner import ServerInfo, warm_up
from pdserve.bench.search import RateSearch, repeat_boundary, search_max_rate
from pdserve.core.config import Mode
from pdserve.redaction import redact_argv, redact_url
from pdserve.workload.errors import BenchError
from pdserve.workload.goodput import (
    DEFAULT_ATTAINMENT,
    SearchPoint,
    SearchResult,
    sustained_count,
)
from pdserve.workload.report import write_report
from pdserve.workload.results import has_records, rate_text, result_from_dict, result_to_dict
from pdserve.workload.run import BenchResult, BenchSpec, WorkloadPlan, plan_workload
from pdserve.workload.table import CompareRow, Layout, format_table, interval_text, resources_of
from pdserve.workload.tokenizer import TokenizerLike, load_tokenizer

DEFAULT_MODES = tuple(mode.value for mode in Mode)
# A search run at a low rate still has this many requests (its attainment means something).
# Without SLOs, modes within this share of the best output throughput compete on ITL p99.
_THROUGHPUT_TOLERANCE = 0.9


@dataclass(frozen=True)
class CompareSpec:
    """Modes to launch in turn (with `launch`) on `num_cores` cores each (None: every core
    here; disagg as `disagg_split` prefill and decode workers, default `layout.disagg_split`),
    plus already-running servers as (name, URL or URL@CORES) rows; `bench` is the workload
    and load applied to every one of them (its endpoint's base URL is replaced per server);
    `search`, when set, also finds each server's highest rate meeting the SLOs, its deciding
    runs repeated for `num_seeds` seeds in all; `saved` names the rows read from saved
    runs."""

    bench: BenchSpec
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    modes: tuple[str, ...] = DEFAULT_MODES
    externals: tuple[tuple[str, str], ...] = ()
    search: RateSearch | None = None
    saved: tuple[str, ...] = ()
    num_cores: int | None = None
    disagg_split: tuple[int, int] | None = None
    num_seeds: int = 1

    def __post_init__(self) -> None:
        if len(self.bench.request_rates) != 1:
            raise BenchError("bench compare takes one --request-rate, not a sweep")
        if self.num_seeds < 1:
            raise BenchError(f"--seeds must be >= 1, got {self.num_seeds}")
        if self.modes:
            resolve_cores(self.num_cores)  # a --cores this machine has
        names = [*self.modes, *(name for name, _ in self.externals), *self.saved]
        if not names:
            raise BenchError(
                "bench compare: nothing to compare; give --modes, --external or --saved"
            )
        if len(set(names)) != len(names):
            raise BenchError(f"bench compare: row names must be unique, got {names}")
        for mode in self.launch.mode_args:
            if mode not in self.modes:
                raise BenchError(f"--mode-args: {mode!r} is not one of --modes {self.modes}")
        if self.search is not None:
            rate = self.request_rate
            if not self.bench.slos:
                raise BenchError("--search-rate needs SLOs to meet: give --goodput")
            if rate is None or not math.isfinite(rate):
                raise BenchError("--search-rate starts from a finite --request-rate")

    @property
    def request_rate(self) -> float | None:
        """The offered rate, the workload's default resolved."""
        return self.bench.workload.resolve_rate(self.bench.request_rates[0])

    @property
    def attainment(self) -> float:
        return self.search.attainment if self.search else DEFAULT_ATTAINMENT

    @property
    def cores(self) -> tuple[int, ...]:
        """The cores every launched mode runs on."""
        return resolve_cores(self.num_cores)

    def layout(self, mode: str) -> Layout:
        return mode_layout(mode, len(self.cores), self.disagg_split)

    def external_layouts(self) -> dict[str, tuple[str, Layout]]:
        """Each external row's URL and declared resources."""
        return {name: parse_external(name, text) for name, text in self.externals}


@dataclass
class SavedRuns:
    """Runs read back from `--saved` files and judged again from their records; `rows` are
    runs known only by their numbers (no records); `layouts` the resources a compare file
    recorded for its rows; `attainment` the saved searches' target."""

    results: dict[str, BenchResult] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    searches: dict[str, tuple[SearchResult, list[BenchResult]]] = field(default_factory=dict)
    rows: dict[str, CompareRow] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    attainment: float | None = None


def load_saved(
    name: str,
    path: str | Path,
    into: SavedRuns,
    slos: Mapping[str, float] | None = None,
    interference: Mapping[str, float] | None = None,
    attainment: float | None = None,
) -> SavedRuns:
    """Add a saved result to `into`: one run named NAME, or every run (and search) of a
    `compare`/`simulate` file named NAME/MODE; judged with `slos`, `interference` settings
    and search `attainment` when given, else those saved with them."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"--saved {name}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or "sweep" in data:
        raise BenchError(f"--saved {name}: {path} holds a sweep or no run; save one rate")
    runs = data["runs"] if isinstance(data.get("runs"), dict) else None
    searches = data.get("search") or {}
    saved_search = (data.get("config") or {}).get("search") or {}
    target = attainment or saved_search.get("attainment") or DEFAULT_ATTAINMENT
    if searches:
        into.attainment = target
    recorded = {row["name"]: row for row in data.get("rows") or [] if isinstance(row, dict)}
    for mode, run in (runs or {name: data}).items():
        label = f"{name}/{mode}" if runs is not None else name
        into.order.append(label)
        if mode in recorded and "layout" in recorded[mode]:
            row = recorded[mode]
            into.layouts[label] = Layout(row["num_engines"], row["num_cores"], row["layout"])
        if not has_records(run):
            into.rows[label] = CompareRow.from_saved(label, run, into.layouts.get(label))
            continue
        result = result_from_dict(run, label, slos, interference)
        into.results[label] = result
        if mode in searches:
            saved = searches[mode]
            again = [
                result_from_dict(r, r["pdserve"].get("label", label), slos, interference)
                for r in saved.get("runs", [])
            ]
            points = tuple(SearchPoint.of(r) for r in [result, *again])
            outcome = SearchResult(target, points, saved.get("stop_reason", ""))
            into.searches[label] = (outcome, again)
    return into


@dataclass(frozen=True)
class Recommendation:
    """The mode to run, or None with the reason no mode is recommended."""

    name: str | None
    reason: str

    def __str__(self) -> str:
        return f"Recommendation: {self.name or 'none'} — {self.reason}."


@dataclass
class CompareResult:
    """`results` and `searches` (each a search's outcome and its runs' results) by row name."""

    spec: CompareSpec
    results: dict[str, BenchResult]
    rows: list[CompareRow]
    recommendation: Recommendation | None
    searches: dict[str, tuple[SearchResult, list[BenchResult]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        bench = self.spec.bench
        # Each run records its own server's URL; the shared config has none.
        shared = {k: v for k, v in bench.describe().items() if k != "base_url"}
        return {
            "config": {
                **shared,
                "request_rate": self.spec.request_rate,
                "modes": list(self.spec.modes),
                "num_cores": len(self.spec.cores) if self.spec.modes else None,
                "layouts": {m: self.spec.layout(m).to_dict() for m in self.spec.modes},
                "num_seeds": self.spec.num_seeds,
                "externals": {name: redact_url(url) for name, url in self.spec.externals},
                "saved": list(self.spec.saved),
                # Saved and shared: API keys, passwords and URLs' credentials left out.
                "server_command": redact_argv(
                    [*self.spec.launch.command, *self.spec.launch.extra_args]
                ),
                "mode_args": {m: redact_argv(a) for m, a in self.spec.launch.mode_args.items()},
                "search": None if self.spec.search is None else asdict(self.spec.search),
            },
            "rows": [asdict(r) for r in self.rows],
            "recommendation": None if self.recommendation is None else asdict(self.recommendation),
            "runs": {name: result_to_dict(r) for name, r in self.results.items()},
            "search": {
                name: {**search.to_dict(), "runs": [result_to_dict(r) for r in runs]}
                for name, (search, runs) in self.searches.items()
            },
        }


def run_compare(spec: CompareSpec, tokenizer: TokenizerLike | None = None) -> CompareResult:
    """Launch each mode in turn, run the workload (and the search), stop it; then the
    externals.

    The workload is built once (fitted to the first server's context) so every row sees the
    same requests at the same times. A server that fails to start becomes a row with its
    error; the comparison goes on.
    """
    runner = _Runner(spec, tokenizer)
    layouts = {mode: spec.layout(mode) for mode in spec.modes}
    for mode, layout in layouts.items():
        try:
            with launch_server(spec.launch, mode, layout.argv, spec.cores) as server:
                runner.run(mode, server.base_url)
        except BenchError as exc:
            runner.fail(mode, str(exc))
    for name, (url, layout) in spec.external_layouts().items():
        layouts[name] = layout
        try:
            runner.run(name, url)
        except BenchError as exc:
            runner.fail(name, str(exc))
    if not runner.results:
        details = "; ".join(f"{r.name}: {r.error}" for r in runner.failed.values())
        raise BenchError(f"bench compare: no server completed a run ({details})")
    failed = {name: replace(r, **resources_of(layouts[name])) for name, r in runner.failed.items()}
    return judged(spec, runner.results, runner.searches, failed, runner.order, layouts)


def judged(
    spec: CompareSpec,
    results: dict[str, BenchResult],
    searches: dict[str, tuple[SearchResult, list[BenchResult]]],
    rows: dict[str, CompareRow] | None = None,
    order: list[str] | None = None,
    layouts: Mapping[str, Layout] | None = None,
) -> CompareResult:
    """The comparison of measured (or saved) runs, in `order` (default: results, then
    `rows`): a row per result (on its `layouts` entry), the prebuilt `rows` (servers that
    never ran, saved runs known only by their numbers) as they are, and the recommendation
    among the rows on the comparison's cores."""
    rows, layouts = rows or {}, layouts or {}
    table = [
        rows[name]
        if name in rows
        else CompareRow.of(
            name, results[name], searches.get(name, (None, []))[0], layouts.get(name)
        )
        for name in order or [*results, *rows]
    ]
    num_cores = len(spec.cores) if spec.modes else None
    recommendation = recommend(
        table, bool(spec.bench.slos), spec.request_rate, spec.attainment, num_cores
    )
    return CompareResult(spec, dict(results), table, recommendation, dict(searches))


class _Runner:
    """Runs the shared plan (and the search) against one server after another."""

    def __init__(self, spec: CompareSpec, tokenizer: TokenizerLike | None) -> None:
        self._spec = spec
        self._tokenizer = tokenizer
        self._plan: WorkloadPlan | None = None
        # Search runs' plans by request count and seed (every server sees the same ones).
        self._plans: dict[tuple[int, int], WorkloadPlan] = {}
        self.results: dict[str, BenchResult] = {}
        self.searches: dict[str, tuple[SearchResult, list[BenchResult]]] = {}
        self.failed: dict[str, CompareRow] = {}
        self.order: list[str] = []

    def run(self, name: str, base_url: str) -> None:
        endpoint = replace(self._spec.bench.endpoint, base_url=base_url)
        bench = replace(self._spec.bench, endpoint=endpoint)
        server = asyncio.run(probe(bench))
        if self._plan is None:
            tokenizer = self._tokenizer or load_tokenizer(None)
            self._plan = plan_workload(
                bench.workload,
                tokenizer,
                bench.seed,
                context_cap(bench, server),
                bench.num_warmups,
            )
        asyncio.run(self._measure(name, bench, self._plan, server))
        self.order.append(name)

    async def _measure(
        self, name: str, bench: BenchSpec, plan: WorkloadPlan, server: ServerInfo
    ) -> None:
        search = self._spec.search
        async with make_http_client(bench.endpoint) as http:
            warmups = await warm_up(http, bench.endpoint, server.model, list(plan.warmups))
            rate = bench.request_rates[0]
            result = await run_rate(http, bench, plan, server, rate, name, warmups)
            self.results[name] = result
            if search is None:
                return
            runs: list[BenchResult] = []

            async def measure(rate: float, seed: int = bench.seed) -> SearchPoint:
                label = rate_label(name, rate) + (f"-seed{seed}" if seed != bench.seed else "")
                run = await run_rate(
                    http,
                    replace(bench, seed=seed),
                    self._plan_at(rate, plan, seed),
                    server,
                    rate,
                    label,
                    warmups,
                    search.is_hopeless(bench.slos),
                )
                runs.append(run)
                point = SearchPoint.of(run)
                if point.is_stopped_early:
                    # The server may still be finishing what the stopped run left: wait for
                    # it to serve a warm-up before the next run starts.
                    await warm_up(http, bench.endpoint, server.model, list(plan.warmups[-1:]))
                return point

            started = time.monotonic()
            outcome = await search_max_rate(SearchPoint.of(result), measure, search)
            seeds = [bench.seed + i for i in range(1, self._spec.num_seeds)]
            outcome = await repeat_boundary(outcome, measure, seeds, search, started)
            self.searches[name] = (outcome, runs)

    def _plan_at(self, rate: float, first: WorkloadPlan, seed: int) -> WorkloadPlan:
        """A search run's requests, drawn with `seed`: as many as keep the first run's span
        at `rate`, so that the rate is sustained (the first plan's count, for a workload
        without a request count)."""
        workload = first.workload
        has_count = any(f.name == "num_prompts" for f in fields(workload))
        if not has_count and seed == first.seed:
            return first
        count = (
            sustained_count(workload.num_prompts, self._spec.request_rate, rate) if has_count else 0
        )
        if (count, seed) not in self._plans:
            tokenizer = self._tokenizer or load_tokenizer(None)
            resized = replace(workload, num_prompts=count) if has_count else workload
            plan = plan_workload(resized, tokenizer, seed, first.max_model_len)
            self._plans[count, seed] = replace(plan, warmups=first.warmups)
        return self._plans[count, seed]

    def fail(self, name: str, error: str) -> None:
        self.failed[name] = CompareRow(name, error=error)
        self.order.append(name)


def recommend(
    rows: list[CompareRow],
    has_slos: bool,
    request_rate: float | None = None,
    attainment: float = DEFAULT_ATTAINMENT,
    num_cores: int | None = None,
) -> Recommendation | None:
    """Pick a mode and say why, or say why none, among the rows on `num_cores` cores (None:
    the core count most rows declare; every row when none does): with SLOs and a search,
    the highest rate at which `attainment` of the requests meet them (DistServe's goodput),
    named only when its interval is clear of every other's; with SLOs only, the highest
    goodput at the offered rate; a tie, or nothing meeting the SLOs, recommends none.
    Without SLOs, the lowest ITL p99 among rows with the fewest failures and near-best
    output throughput. Rows left out are named with the reason."""
    ran = [r for r in rows if r.error is None and r.completed + r.failed > 0]
    if not ran:
        return None
    ranked, left_out = _on_equal_resources(ran, num_cores)
    note = "".join(f"; {r.name} not ranked: {why}" for r, why in left_out)
    if not ranked:
        return Recommendation(None, "no row ran on the comparison's cores" + note)
    if not has_slos:
        recommendation = _by_itl(ranked)
    elif any(r.is_searched for r in ranked):
        recommendation = _by_max_rate(ranked, request_rate, attainment)
    else:
        recommendation = _by_goodput(ranked, request_rate)
    return Recommendation(recommendation.name, recommendation.reason + _findings(ranked) + note)


def _on_equal_resources(
    ran: list[CompareRow], num_cores: int | None
) -> tuple[list[CompareRow], list[tuple[CompareRow, str]]]:
    """The rows to rank, and the others with the reason they are not."""
    if num_cores is None:
        declared = Counter(r.num_cores for r in ran if r.num_cores is not None)
        if not declared:
            return ran, []  # nothing recorded: compared as given
        num_cores = declared.most_common(1)[0][0]
    ranked, left_out = [], []
    for row in ran:
        if row.num_cores == num_cores:
            ranked.append(row)
        elif row.num_cores is None:
            left_out.append((row, "its cores are not declared (--external NAME=URL@CORES)"))
        else:
            left_out.append((row, f"it ran on {row.num_cores} cores, the others on {num_cores}"))
    return ranked, left_out


def _by_max_rate(
    ran: list[CompareRow], request_rate: float | None, attainment: float
) -> Recommendation:
    searched = [r for r in ran if r.is_searched]
    ranked = sorted(searched, key=lambda r: r.max_rate or 0.0, reverse=True)
    best = ranked[0]
    sustains = ", ".join(f"{r.name} {interval_text(r)}" for r in ranked)
    share = f"{attainment:.0%} of requests within the SLOs"
    at_rate = _at_offered_rate(ran, request_rate)
    if not best.max_rate:
        return Recommendation(None, f"none at any searched load: no mode kept {share} ({sustains})")
    # Clear: every other mode missed at a rate (at every seed) that the best met (at every
    # seed), so no seed's luck decides it.
    if not all(
        r.min_missed_rate is not None and best.max_rate >= r.min_missed_rate for r in ranked[1:]
    ):
        return Recommendation(
            None,
            f"no clear winner on this machine: the highest loads with {share} overlap "
            f"({sustains} req/s){at_rate}",
        )
    reason = (
        f"highest load with {share}, {best.max_rate:.3g} req/s, clear of the others "
        f"(highest loads: {sustains} req/s)"
    )
    return Recommendation(best.name, reason + at_rate)


def _at_offered_rate(ran: list[CompareRow], request_rate: float | None) -> str:
    if any(r.num_good for r in ran):
        return ""
    return f"; at the offered {rate_text(request_rate)} req/s no mode met every SLO"


def _by_goodput(ran: list[CompareRow], request_rate: float | None) -> Recommendation:
    ranked = sorted(ran, key=lambda r: (_num_good(r), r.goodput or 0.0), reverse=True)
    best = ranked[0]
    load = f"{rate_text(request_rate)} req/s"
    search_hint = "; --search-rate finds the highest load each mode sustains"
    if not _num_good(best):
        return Recommendation(
            None,
            f"none at this load: no mode met every SLO for any request at {load}" + search_hint,
        )
    if len(ranked) > 1 and _num_good(ranked[1]) == _num_good(best):
        tied = " and ".join(r.name for r in ranked if _num_good(r) == _num_good(best))
        total = best.completed + best.failed
        return Recommendation(
            None,
            f"none at this load: {tied} tie, {_num_good(best)} of {total} requests within "
            f"the SLOs each at {load}" + search_hint,
        )
    others = _versus(ran, best, lambda r: f"{r.goodput or 0.0:.3f}")
    reason = f"highest goodput under the SLOs, {best.goodput or 0.0:.3f} req/s{others}"
    return Recommendation(best.name, reason)


def _num_good(row: CompareRow) -> float:
    """Requests meeting every SLO; from goodput when a saved row lacks the count."""
    return row.num_good if row.num_good is not None else (row.goodput or 0.0)


def _by_itl(ran: list[CompareRow]) -> Recommendation:
    fewest_failed = min(r.failed for r in ran)
    top = max(r.output_throughput for r in ran if r.failed == fewest_failed)
    eligible = [
        r
        for r in ran
        if r.failed == fewest_failed and r.output_throughput >= _THROUGHPUT_TOLERANCE * top
    ]
    best = min(eligible, key=lambda r: r.itl_p99)
    others = _versus(ran, best, lambda r: f"{r.itl_p99:.0f} ms")
    share = best.output_throughput / top if top else 1.0
    reason = (
        f"lowest ITL p99, {best.itl_p99:.0f} ms{others}, at {share:.0%} of the best output "
        "throughput (no --goodput SLOs given)"
    )
    return Recommendation(best.name, reason)


def _findings(ran: list[CompareRow]) -> str:
    """The detector's findings across rows, for the recommendation's reason."""
    notes = []
    interfering = [r for r in ran if r.is_interference]
    if interfering:
        names = ", ".join(
            f"{r.name} ({r.in_prefill_fraction:.0%} of its stalled time during long prefills, "
            f"costing {r.prefill_slowdown:.0%} of streaming time)"
            for r in interfering
        )
        notes.append(f"phase interference in {names}")
    overloaded = [r for r in ran if r.is_overload]
    if overloaded:
        names = ", ".join(f"{r.name} ({r.overload_slowdown:.1f}× slower)" for r in overloaded)
        notes.append(f"overloaded at this load, streams slower than unloaded: {names}")
    return "".join(f"; {note}" for note in notes)


def _versus(rows: list[CompareRow], best: CompareRow, value) -> str:
    others = [f"{r.name} {value(r)}" for r in rows if r is not best]
    return f" (vs {', '.join(others)})" if others else ""


def save_compare(
    result: CompareResult,
    out_dir: str | Path,
    json_path: str | Path | None = None,
    intro: Sequence[str] = (),
):
    """Write the combined JSON (default `out_dir/compare.json`) and the report (`intro`
    lines first); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_file = Path(json_path) if json_path else out / "compare.json"
    json_file.write_text(json.dumps(result.to_dict(), indent=1))
    bench = result.spec.bench
    slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in bench.slos.items()) or "none given"
    preamble = [
        *intro,
        "## Comparison",
        "",
        f"Offered load {rate_text(result.spec.request_rate)} req/s; SLOs: {slos}. Every mode "
        f"on the same cores ({_cores_text(result.spec)}); *layout*: the engines each row ran. "
        "Latencies in ms, goodput and max rate in req/s. *SLO met*: share of requests meeting "
        f"every SLO; *max rate*: the interval in which the highest rate lies at which "
        f"{result.spec.attainment:.0%} do: met by every seed that ran its low end, missed by "
        f"every seed at its high end ({result.spec.num_seeds} seeds at the deciding rates; "
        ">=: met at every rate tried); *per core*: its low end (else the goodput) per core; "
        "*in prefill*: share of stalled time (gaps above "
        f"{bench.interference.spike_factor:g}× their stream's pace) during long prompts' "
        "prefills; *finding*: interference, overload, both or neither (per run below).",
        "",
        format_table(result.rows, markdown=True),
        "",
        f"**{result.recommendation}**" if result.recommendation else "",
        *[f"- {r.name}: failed to run: {r.error}" for r in result.rows if r.error],
        *_search_section(result, out),
    ]
    report = write_report(
        list(result.results.values()), out, "pdserve bench compare", "\n".join(preamble)
    )
    return json_file, report


def _cores_text(spec: CompareSpec) -> str:
    if not spec.modes:
        return "as each saved run recorded"
    cores = spec.cores
    return f"{len(cores)} cores: {','.join(map(str, cores))}"


def _search_section(result: CompareResult, out: Path) -> list[str]:
    if not result.searches:
        return []
    from pdserve.workload.plots import plot_attainment  # matplotlib only for reports

    target = result.spec.attainment
    curves = {
        name: [(p.rate, p.attainment, p.is_stopped_early) for p in search.points]
        for name, (search, _) in result.searches.items()
    }
    plot_attainment(curves, target, out / "slo_attainment.png")
    lines = [
        "",
        "## Highest rate meeting the SLOs",
        "",
        f"Each server's search for the highest request rate at which {target:.0%} of "
        "requests meet every SLO (runs stopped early once decided: their share is at most "
        "what is shown).",
        "",
        "| mode | max rate | rates tried (SLO met) | stopped because |",
        "|---|---|---|---|",
    ]
    for name, (search, _) in result.searches.items():
        tried = ", ".join(
            f"{p.rate:.3g} ({p.attainment:.0%}{'*' if p.is_stopped_early else ''}"
            f"{'' if p.seed in (None, result.spec.bench.seed) else f' seed {p.seed}'})"
            for p in sorted(search.points, key=lambda p: p.rate)
        )
        lines.append(f"| {name} | {search.describe()} | {tried} | {search.stop_reason} |")
    return [*lines, "", "![SLO attainment vs rate](slo_attainment.png)"]
