"""`pdserve plan`: simulate candidate layouts of N GPUs and rank them by goodput per GPU.

Goodput is the benchmark's: requests per second that meet every SLO. A layout "carries" a
rate when at least `ATTAINMENT_TARGET` of the requests meet the SLOs (DistServe's criterion).

Two stages: every candidate is simulated at the planned rate; then the best few of each mode
(the finalists) get their capacity, the highest rate they carry, found by scaling the same
requests' arrival times. Finalists rank by capacity per GPU (the goodput per GPU each layout
sustains under the SLOs), the rest by their goodput at the planned rate.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pdserve.core.config import DEFAULT_CHUNKED_BUDGET, Mode
from pdserve.sim.cost_model import CostModel
from pdserve.sim.errors import SimConfigError
from pdserve.sim.layout import Layout
from pdserve.sim.report import bench_result, scaled
from pdserve.sim.simulator import SimResult, simulate
from pdserve.sim.workload import SimRequestSpec
from pdserve.workload.metrics import meets_slos
from pdserve.workload.run import BenchResult

ATTAINMENT_TARGET = 0.9
TP_DEGREES = (1, 2, 4, 8)
BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
MAX_SPLITS = 7
THRESHOLDS = (256, 1024, 4096)
# Decode workers' budgets for their local prefills (those below the layout's own budget).
DECODE_BUDGETS = (128, 256, 512, 1024)
FINALISTS_PER_MODE = 2
# Capacity search: at most this many doublings/halvings of the rate, then bisections.
_MAX_DOUBLINGS = 5
_BISECTIONS = 3

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ProgressLines:
    """A `Progress` that prints each message on stderr, or nothing when quiet; a plain
    object, so worker processes (`simulate scale`'s parallel searches) print through it."""

    is_quiet: bool = False

    def __call__(self, message: str) -> None:
        if not self.is_quiet:
            print(message, file=sys.stderr, flush=True)


QUIET = ProgressLines(is_quiet=True)


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    num_gpus: int
    sim: SimResult
    result: BenchResult
    slos: dict[str, float]
    # Highest rate (req/s) carried, for finalists; None until measured.
    capacity: float | None = None

    @property
    def capacity_per_gpu(self) -> float | None:
        return None if self.capacity is None else self.capacity / self.num_gpus

    @property
    def label(self) -> str:
        return self.layout.label(self.num_gpus)

    @property
    def goodput(self) -> float:
        return self.result.metrics.request_goodput or 0.0

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.num_gpus

    @property
    def attainment(self) -> float:
        records = self.result.records
        return sum(meets_slos(r, self.slos) for r in records) / len(records)

    @property
    def carries_load(self) -> bool:
        return self.attainment >= ATTAINMENT_TARGET

    def binding_slo(self) -> str:
        """The SLO most requests miss; if all are met, the one with the least headroom."""
        misses = {name: 0 for name in self.slos}
        for record in self.result.records:
            if record.success:
                observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
                for name, limit in self.slos.items():
                    misses[name] += observed[name] * 1000 > limit
        if any(misses.values()):
            return max(misses, key=misses.get)
        m = self.result.metrics
        return max(self.slos, key=lambda name: getattr(m, name).p99 / self.slos[name])


@dataclass(frozen=True)
class PlanInputs:
    """What every candidate is simulated on."""

    deployment: object  # options.Deployment
    planned: object  # options.PlannedWorkload
    slos: dict[str, float]
    # The calibration the deployment runs at: its band bounds the answers (None: no band).
    band: float | None = None


@dataclass(frozen=True)
class Banded:
    """A layout's figures at both ends of the calibration band: every step (1 − band) and
    (1 + band) times as long; capacities for the recommendation only."""

    low: Evaluation
    high: Evaluation
    capacity: tuple[float, float] | None = None


def band_of(
    inputs: PlanInputs, evaluation: Evaluation, progress: Progress, with_capacity: bool = False
) -> Banded | None:
    """`evaluation` re-simulated at the band's two ends (None without a band)."""
    if not inputs.band:
        return None
    scales = (1 - inputs.band, 1 + inputs.band)
    low, high = (
        evaluate(inputs, evaluation.layout, evaluation.num_gpus, time_scale=s) for s in scales
    )
    capacity = None
    if with_capacity:
        capacity = tuple(
            find_capacity(inputs, evaluation.layout, evaluation.num_gpus, progress, s)
            for s in scales
        )
    return Banded(low, high, capacity)


def candidate_layouts(inputs: PlanInputs, num_gpus: int) -> list[Layout]:
    """Colocated per TP, chunked per TP × budget, disagg per TP × prefill share."""
    layouts: list[Layout] = []
    for tp in feasible_tps(inputs, num_gpus):
        layouts.append(Layout(Mode.COLOCATED, tp))
        layouts += [Layout(Mode.CHUNKED, tp, budget=b) for b in BUDGETS]
        layouts += [
            Layout(Mode.DISAGG, tp, prefill_tp=tp, prefill_fraction=k * tp / num_gpus)
            for k in _split_counts(num_gpus // tp)
        ]
    return layouts


def feasible_tps(inputs: PlanInputs, num_gpus: int) -> list[int]:
    """TP degrees inside one node that divide the GPUs and hold the longest request's KV."""
    deployment = inputs.deployment
    hardware = deployment.hardware
    longest = max(
        min(s.prompt_len + s.output_len, deployment.max_model_len) for s in inputs.planned.specs
    )
    tps = []
    for tp in TP_DEGREES:
        if tp > hardware.devices_per_node or num_gpus % tp:
            continue
        cost = CostModel(deployment.model, hardware, tp)
        try:
            capacity = cost.kv_capacity_tokens(max(BUDGETS), deployment.max_num_seqs)
        except SimConfigError:
            continue
        if capacity >= longest:
            tps.append(tp)
    if not tps:
        raise SimConfigError(
            f"{deployment.model.name} does not fit {num_gpus} "
            f"{hardware.name} at any TP of {TP_DEGREES}"
        )
    return tps


def _split_counts(num_workers: int) -> list[int]:
    """Up to MAX_SPLITS prefill-worker counts spread over 1 .. num_workers − 1."""
    if num_workers < 2:
        return []
    if num_workers - 1 <= MAX_SPLITS:
        return list(range(1, num_workers))
    step = (num_workers - 1) / MAX_SPLITS
    return sorted({max(1, round(step * (i + 0.5))) for i in range(MAX_SPLITS)})


def evaluate(
    inputs: PlanInputs,
    layout: Layout,
    num_gpus: int,
    specs=None,
    request_rate=None,
    time_scale: float = 1.0,
) -> Evaluation | None:
    """Simulate `layout` on `num_gpus` (None if it does not divide them), every step
    `time_scale` times as long as modelled (the calibration band's bounds)."""
    planned = inputs.planned
    config = layout.config(inputs.deployment, num_gpus, max_concurrency=planned.max_concurrency)
    if config is None:
        return None
    if time_scale != 1:
        config = scaled(config, time_scale)
    sim = simulate(config, specs if specs is not None else planned.specs)
    result = bench_result(
        sim,
        planned.workload,
        seed=planned.seed,
        request_rate=request_rate or planned.request_rate,
        burstiness=planned.burstiness,
        slos=inputs.slos,
        label=layout.label(num_gpus),
    )
    return Evaluation(layout, num_gpus, sim, result, inputs.slos)


def rank(evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """Best first: capacity per GPU (finalists), then goodput per GPU at the planned rate,
    SLO attainment, lower p99 TTFT."""
    return sorted(
        evaluations,
        key=lambda e: (
            e.capacity is None,
            -(e.capacity_per_gpu or 0.0),
            -e.goodput_per_gpu,
            -e.attainment,
            e.result.metrics.ttft.p99,
        ),
    )


def search(inputs: PlanInputs, num_gpus: int, progress: Progress) -> list[Evaluation]:
    """Every candidate at the planned rate; local-prefill thresholds on the best
    disaggregated one, then decode budgets on the best with a threshold; then the finalists'
    capacities."""
    evaluations = []
    layouts = candidate_layouts(inputs, num_gpus)
    for i, layout in enumerate(layouts, start=1):
        progress(f"[{i}/{len(layouts)}] {layout.label(num_gpus)}")
        evaluation = evaluate(inputs, layout, num_gpus)
        if evaluation is not None:
            evaluations.append(evaluation)
    best = _best_disagg(evaluations)
    if best is not None:
        _refine(
            inputs,
            num_gpus,
            progress,
            evaluations,
            "threshold",
            [replace(best, local_prefill_threshold=t) for t in THRESHOLDS],
        )
    best = _best_disagg(evaluations, is_local=True)
    if best is not None:
        budget = best.budget or DEFAULT_CHUNKED_BUDGET
        _refine(
            inputs,
            num_gpus,
            progress,
            evaluations,
            "decode budget",
            [replace(best, decode_budget=b) for b in DECODE_BUDGETS if b < budget],
        )
    ranked = rank(evaluations)
    finalists = [
        e
        for mode in Mode
        for e in [x for x in ranked if x.layout.mode is mode][:FINALISTS_PER_MODE]
    ]
    for evaluation in finalists:
        capacity = find_capacity(inputs, evaluation.layout, num_gpus, progress)
        evaluations[evaluations.index(evaluation)] = replace(evaluation, capacity=capacity)
    return rank(evaluations)


def _best_disagg(evaluations: list[Evaluation], is_local: bool = False) -> Layout | None:
    """The best-ranked disaggregated layout (with a local-prefill threshold if `is_local`)."""
    for evaluation in rank(evaluations):
        layout = evaluation.layout
        if layout.mode is Mode.DISAGG and (layout.local_prefill_threshold > 0 or not is_local):
            return layout
    return None


def _refine(
    inputs: PlanInputs,
    num_gpus: int,
    progress: Progress,
    evaluations: list[Evaluation],
    stage: str,
    layouts: list[Layout],
) -> None:
    """Evaluate variants of a layout, appending them to `evaluations`."""
    for layout in layouts:
        progress(f"[{stage}] {layout.label(num_gpus)}")
        evaluation = evaluate(inputs, layout, num_gpus)
        if evaluation is not None:
            evaluations.append(evaluation)


def planned_rate(inputs: PlanInputs) -> float:
    """The planned workload's mean arrival rate (its own pace for a trace)."""
    planned = inputs.planned
    if planned.request_rate is not None and math.isfinite(planned.request_rate):
        return planned.request_rate
    times = [s.arrival_time for s in planned.specs]
    span = max(times) - min(times)
    if not span > 0:
        raise SimConfigError("plan needs a finite --request-rate (the traffic to plan for)")
    return (len(times) - 1) / span


def at_rate(specs, base_rate: float, rate: float) -> list:
    """The same requests, arrival times scaled from `base_rate` to `rate`."""
    return [replace(s, arrival_time=s.arrival_time * base_rate / rate) for s in specs]


def search_ceiling(inputs: PlanInputs) -> float:
    """The highest rate `find_capacity` tries: a capacity there is only a lower bound."""
    return planned_rate(inputs) * 2**_MAX_DOUBLINGS


def find_capacity(
    inputs: PlanInputs,
    layout: Layout,
    num_gpus: int,
    progress: Progress,
    time_scale: float = 1.0,
    specs_at: Callable[[float], list[SimRequestSpec]] | None = None,
    growth: float = 2.0,
) -> float:
    """The highest rate (req/s, within a few percent) at which `layout` carries the planned
    requests; 0 when it does not carry them even at 1/32 of the planned rate. `specs_at`
    gives the requests offered at a rate (default: the planned ones, their arrivals
    compressed or stretched to it); from the planned rate the search steps by `growth` until
    it brackets the capacity (a smaller step from a close guess runs fewer, smaller
    simulations), within the same bounds."""
    base = planned_rate(inputs)
    specs = inputs.planned.specs

    def carries(rate: float) -> bool:
        scaled_specs = specs_at(rate) if specs_at else at_rate(specs, base, rate)
        evaluation = evaluate(inputs, layout, num_gpus, scaled_specs, rate, time_scale)
        progress(
            f"[capacity] {layout.label(num_gpus)} at {rate:.3g} req/s: "
            f"{evaluation.attainment:.0%} within SLOs"
        )
        return evaluation.carries_load

    good, bad = (base, None) if carries(base) else (None, base)
    for _ in range(math.ceil(_MAX_DOUBLINGS * math.log(2) / math.log(growth) - 1e-9)):
        if good is not None and bad is not None:
            break
        if good is not None:
            rate = good * growth
            good, bad = (rate, bad) if carries(rate) else (good, rate)
        else:
            rate = bad / growth
            good, bad = (rate, bad) if carries(rate) else (good, rate)
    if good is None:
        return 0.0
    if bad is None:
        return good
    for _ in range(_bisections(growth)):
        middle = math.sqrt(good * bad)
        good, bad = (middle, bad) if carries(middle) else (good, middle)
    return good


def _bisections(growth: float) -> int:
    """As many halvings of a `growth`-wide bracket's log width as leave it about as narrow
    as `_BISECTIONS` leave a doubling's."""
    return max(1, round(_BISECTIONS - math.log2(math.log(2) / math.log(growth))))


def capacity_resolution(growth: float = 2.0) -> float:
    """The ratio of the bracket `find_capacity` ends with: capacities closer than this
    are a tie."""
    return growth ** (0.5 ** _bisections(growth))


def gpus_for_rate(
    inputs: PlanInputs, layout: Layout, target_rate: float, specs, max_gpus: int, progress: Progress
) -> int | None:
    """Fewest GPUs (a multiple of the layout's granularity, up to `max_gpus`) at which
    `layout` carries `specs` arriving at `target_rate`; None if not within `max_gpus`."""
    step = layout.granularity
    minimum = step * (2 if layout.mode is Mode.DISAGG else 1)

    def carries(num_gpus: int) -> bool:
        evaluation = evaluate(inputs, layout, num_gpus, specs, target_rate)
        ok = evaluation is not None and evaluation.carries_load
        progress(f"[inverse] {layout.label(num_gpus)}: {'carries' if ok else 'misses'}")
        return ok

    low, high = 0, minimum
    while not carries(high):  # doubling: find a size that carries the rate
        low = high
        if high >= max_gpus:
            return None
        high = min(high * 2, max_gpus)
    while high - low > step:  # bisection between a failing and a carrying size
        middle = (low + high) // 2 // step * step
        if middle <= low or middle < minimum:
            break
        if carries(middle):
            high = middle
        else:
            low = middle
    return high
