"""Command-line options of `simulate` and `plan`, and the configs built from them.

Workload options keep the benchmark's names and meanings (`pdserve bench --help`), and are
turned into the benchmark's own workload objects.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.core.config import DEFAULT_CHUNKED_BUDGET, CacheConfig, Mode, SchedulerConfig
from pdserve.engine.args import ENGINE_FLAGS
from pdserve.flags import Flag, add_flags
from pdserve.router.autoscale.planner import Decision
from pdserve.router.cli import AUTOSCALE_FLAGS, ROUTING_FLAGS, autoscale_config_from_args
from pdserve.router.config import KVHandoff, RouterConfig
from pdserve.server.cli import SERVER_FLAGS
from pdserve.sim.config import (
    DEFAULT_STARTUP_S,
    DEFAULT_SWITCH_S,
    PoolConfig,
    SimAutoscale,
    SimConfig,
    scheduler_config_for,
)
from pdserve.sim.efficiency import Efficiency
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import Hardware, get_hardware
from pdserve.sim.model_spec import ModelSpec, load_model_spec
from pdserve.sim.network import get_network
from pdserve.sim.workload import SimRequestSpec, plan_requests, specs_from_bench_result
from pdserve.workload import (
    TraceWorkload,
    Workload,
    make_workload,
)
from pdserve.workload.arrivals import parse_request_rates
from pdserve.workload.errors import BenchError
from pdserve.workload.flags import WORKLOAD_FLAGS, workload_options
from pdserve.workload.metrics import parse_goodput
from pdserve.workload.run import TRACE_WINDOW_STREAM, seeded_rng
from pdserve.workload.trace_file import TraceEntry

# On cpu-local the engine's own defaults (core.config) apply. Datacenter default: vLLM's
# sequence cap on large GPUs (its chunked budget, 2,048, is the engine's own).
GPU_MAX_NUM_SEQS = 256


def is_local_cpu(hardware: Hardware) -> bool:
    return hardware.name.startswith("cpu-local")


# ---- parsers ---------------------------------------------------------------------------
def _reused(flags: tuple[Flag, ...], name: str, **changes: Any) -> Flag:
    """The engine's or the router's own declaration of `name`, with the simulator's
    `changes` (a default that depends on the simulated device is None here)."""
    return next(option for option in flags if option.name == name).with_options(**changes)


# What `serve` takes, as it declares it (type, choices, meaning); defaults as the simulated
# device wants them.
ENGINE_FLAGS_SIMULATED = (
    _reused(
        ENGINE_FLAGS,
        "--max-num-seqs",
        default=None,
        help=f"default {SchedulerConfig.max_num_seqs} on cpu-local, {GPU_MAX_NUM_SEQS} otherwise",
    ),
    _reused(ENGINE_FLAGS, "--max-model-len"),
    _reused(ENGINE_FLAGS, "--long-prefill-token-threshold"),
    _reused(ENGINE_FLAGS, "--max-num-partial-prefills"),
    _reused(ENGINE_FLAGS, "--block-size"),
    _reused(ENGINE_FLAGS, "--num-kv-blocks", help="per worker (default: from memory)"),
    _reused(
        ENGINE_FLAGS,
        "--kv-cache-memory-gb",
        default=None,
        help=f"KV budget per worker (default {CacheConfig.kv_cache_memory_gb} on cpu-local, "
        "else device memory minus weights)",
    ),
    _reused(ENGINE_FLAGS, "--no-prefix-caching"),
    _reused(ROUTING_FLAGS, "--prefill-policy", default=RouterConfig.prefill_policy),
    _reused(ROUTING_FLAGS, "--decode-policy", default=RouterConfig.decode_policy),
    _reused(ROUTING_FLAGS, "--kv-handoff"),
    _reused(SERVER_FLAGS, "--burst-gap"),
)
_BUDGET_HELP = (
    f"chunked token budget (default {DEFAULT_CHUNKED_BUDGET}; colocated: the context length)"
)
_LOCAL_HELP = "disagg: prompts with fewer uncached tokens prefill on decode"


def add_deployment_args(parser: argparse.ArgumentParser, *, with_layout: bool) -> None:
    """Model, hardware, links and engine knobs; `with_layout` adds mode and worker counts."""
    g = parser.add_argument_group("deployment")
    g.add_argument(
        "--model",
        default="SmolLM2-135M",
        help="catalog model or a Hugging Face config.json (default: %(default)s)",
    )
    g.add_argument(
        "--hardware",
        default="cpu-local",
        help="H100-SXM, H200, A100-80GB, L40S, B200, cpu-local[:N] (default: %(default)s)",
    )
    g.add_argument(
        "--network",
        help="link between nodes: ib-400, ib-8x400, roce-100, "
        "roce-400, eth-25, ... or a number of Gb/s "
        "(default: ib-8x400; shm on cpu-local)",
    )
    g.add_argument("--dtype", default=SimConfig.dtype, choices=["bf16", "fp8"], help="weights")
    g.add_argument("--kv-dtype", default=SimConfig.kv_dtype, choices=["bf16", "fp8"])
    g.add_argument(
        "--calibration",
        metavar="FILE.json",
        help="a calibration: a file from `pdserve simulate calibrate`, or a shipped one's "
        "name (docs/calibrations.md); default: the device's shipped one, if any",
    )
    add_flags(g, None, ENGINE_FLAGS_SIMULATED)
    g.add_argument("--memory-utilization", type=float, default=SimConfig.memory_utilization)
    if not with_layout:
        return
    lay = parser.add_argument_group("layout")
    lay.add_argument(
        "--mode",
        default=Mode.CHUNKED.value,
        help="colocated, chunked, disagg, or several comma-separated (simulated side by side)",
    )
    lay.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per worker")
    lay.add_argument(
        "--num-workers",
        type=int,
        default=1,
        help="colocated/chunked: engine instances behind the router",
    )
    add_flags(lay, None, (_reused(ENGINE_FLAGS, "--max-num-batched-tokens", help=_BUDGET_HELP),))
    lay.add_argument("--prefill-workers", type=int, default=1, help="disagg")
    lay.add_argument("--decode-workers", type=int, default=1, help="disagg")
    lay.add_argument("--prefill-tp", type=int, help="disagg (default: --tp)")
    lay.add_argument("--decode-tp", type=int, help="disagg (default: --tp)")
    add_flags(lay, None, (_reused(ROUTING_FLAGS, "--local-prefill-threshold", help=_LOCAL_HELP),))
    lay.add_argument(
        "--decode-max-num-batched-tokens",
        type=int,
        help="disagg: the decode workers' token budget, which chunks their local "
        "prefills (serve's --decode-worker-args; default: the same budget)",
    )
    lay.add_argument("--horizon", type=float, help="stop the clock after S simulated seconds")
    add_flags(
        parser,
        "autoscaling (disagg: the router's planner on the simulated pools)",
        (*AUTOSCALE_FLAGS,),
    )
    auto = parser.add_argument_group("autoscaling: how long the fleet's changes take")
    auto.add_argument(
        "--worker-startup",
        type=float,
        default=DEFAULT_STARTUP_S,
        metavar="SECONDS",
        help="from the decision to add a worker to its first request (default: %(default)s)",
    )
    auto.add_argument(
        "--role-switch-time",
        type=float,
        default=DEFAULT_SWITCH_S,
        metavar="SECONDS",
        help="a drained worker's switch to the other pool (default: %(default)s)",
    )
    auto.add_argument(
        "--autoscale-decisions",
        type=Path,
        metavar="FILE",
        help="make these decisions at their times instead of the planner's (JSON: a list, or "
        "a live router's GET /autoscale with the times on this run's clock): the simulator "
        "judged on a live run's path",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's workload options (same names), plus --duration and --workload-from."""
    add_flags(parser, "workload (as pdserve bench)", WORKLOAD_FLAGS)
    g = parser.add_argument_group("traffic")
    g.add_argument(
        "--workload-from",
        metavar="FILE.json",
        help="replay the requests of a `pdserve bench --save-result` run",
    )
    g.add_argument("--request-rate", help="req/s or inf (default: the workload's)")
    g.add_argument(
        "--duration",
        type=float,
        help="seconds of traffic: num-prompts = rate × duration (trace: a window)",
    )
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--seed", type=int, default=0)


# ---- deployments -----------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutOptions:
    """`simulate`'s one layout (its layout and autoscaling options; `plan` searches layouts
    itself)."""

    tp: int = 1
    num_workers: int = 1
    max_num_batched_tokens: int | None = None  # None: the device's chunked budget
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    prefill_tp: int | None = None  # None: `tp`
    decode_tp: int | None = None
    decode_max_num_batched_tokens: int | None = None  # None: the prefill pool's budget
    local_prefill_threshold: int = RouterConfig.local_prefill_threshold
    horizon_s: float | None = None
    autoscale: SimAutoscale | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LayoutOptions:
        return cls(
            tp=args.tp,
            num_workers=args.num_workers,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_prefill_workers=args.prefill_workers,
            num_decode_workers=args.decode_workers,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            decode_max_num_batched_tokens=args.decode_max_num_batched_tokens,
            local_prefill_threshold=args.local_prefill_threshold,
            horizon_s=args.horizon,
            autoscale=sim_autoscale(args),
        )


@dataclass(frozen=True)
class Deployment:
    """Everything but the layout: model, device, links, engine knobs, parsed once from the
    command line (`from_args`), the simulated device's defaults resolved."""

    model: ModelSpec
    hardware: Hardware
    max_num_seqs: int
    max_model_len: int
    network: str  # a `sim.network` link name, or Gb/s
    # The workers' KV cache and the router, as `SimConfig` embeds them.
    cache: CacheConfig = field(default_factory=CacheConfig)
    is_kv_cache_from_memory: bool = SimConfig.is_kv_cache_from_memory
    router: RouterConfig = field(default_factory=lambda: RouterConfig((), ()))
    calibration: str | None = None  # `Efficiency.load`'s argument; None: the device's default
    dtype: str = SimConfig.dtype
    kv_dtype: str = SimConfig.kv_dtype
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills
    memory_utilization: float = SimConfig.memory_utilization
    burst_gap_s: float = SimConfig.burst_gap_s
    seed: int = SimConfig.seed
    layout: LayoutOptions | None = None  # `simulate`'s (None: `plan`'s, which has none)

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, with_layout: bool = False) -> Deployment:
        """`with_layout`: the command has `add_deployment_args`' layout options (`simulate`)."""
        model, hardware = load_model_spec(args.model), get_hardware(args.hardware)
        is_local = is_local_cpu(hardware)
        max_model_len = args.max_model_len or model.max_position_embeddings
        kv_gb = args.kv_cache_memory_gb
        if kv_gb is None and args.num_kv_blocks is None and is_local:
            kv_gb = CacheConfig.kv_cache_memory_gb
        if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
            raise SimConfigError("--num-kv-blocks must be >= 1")
        if kv_gb is not None and not kv_gb > 0:
            raise SimConfigError("--kv-cache-memory-gb must be positive")
        try:
            cache = CacheConfig(
                args.block_size,
                args.num_kv_blocks,
                args.enable_prefix_caching,
                CacheConfig.kv_cache_memory_gb if kv_gb is None else kv_gb,
            )
            router = RouterConfig(
                (),
                (),
                prefill_policy=args.prefill_policy,
                decode_policy=args.decode_policy,
                kv_handoff=KVHandoff(args.kv_handoff),
                block_size=args.block_size,
            )
        except ValueError as exc:
            raise SimConfigError(str(exc)) from None
        return cls(
            model,
            hardware,
            max_num_seqs=args.max_num_seqs
            or (SchedulerConfig.max_num_seqs if is_local else GPU_MAX_NUM_SEQS),
            max_model_len=min(max_model_len, model.max_position_embeddings),
            network=args.network or ("shm" if is_local else "ib-8x400"),
            cache=cache,
            is_kv_cache_from_memory=kv_gb is None,
            router=router,
            calibration=args.calibration,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_num_partial_prefills=args.max_num_partial_prefills,
            memory_utilization=args.memory_utilization,
            burst_gap_s=args.burst_gap,
            seed=args.seed,
            layout=LayoutOptions.from_args(args) if with_layout else None,
        )

    def config(
        self,
        mode: Mode,
        *,
        tp: int = 1,
        num_workers: int = 1,
        budget: int | None = None,
        prefill: tuple[int, int] | None = None,
        decode: tuple[int, int] | None = None,
        decode_budget: int | None = None,
        local_prefill_threshold: int = RouterConfig.local_prefill_threshold,
        **overrides,
    ) -> SimConfig:
        """A layout: `num_workers` × `tp` (colocated/chunked), or `prefill`/`decode` as
        (workers, tp) pools (disagg), the decode pool on `decode_budget` when given, the
        router's `local_prefill_threshold` (disagg)."""
        if mode is Mode.COLOCATED:
            budget = None  # prompts whole: the scheduler's colocated budget, the context length
        elif budget is None:
            budget = DEFAULT_CHUNKED_BUDGET
        for flag, value in (
            ("--max-num-batched-tokens", budget),
            ("--decode-max-num-batched-tokens", decode_budget),
        ):
            if value is not None and value < 1:
                raise SimConfigError(f"{flag} must be >= 1, got {value}")
        sched = scheduler_config_for(
            mode,
            budget,
            self.max_num_seqs,
            self.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
        )
        if mode is Mode.DISAGG:
            decode_sched = (
                sched
                if decode_budget is None
                else replace(sched, max_num_batched_tokens=decode_budget)
            )
            pool, prefill_pool = PoolConfig(*decode, decode_sched), PoolConfig(*prefill, sched)
        else:
            pool, prefill_pool = PoolConfig(num_workers, tp, sched), None
        if local_prefill_threshold < 0:
            raise SimConfigError("--local-prefill-threshold must be >= 0")
        efficiency = Efficiency.load(self.calibration) if self.calibration else None
        fields = dict(
            network=get_network(self.network),
            cache=self.cache,
            is_kv_cache_from_memory=self.is_kv_cache_from_memory,
            router=replace(self.router, local_prefill_threshold=local_prefill_threshold),
            efficiency=efficiency,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            memory_utilization=self.memory_utilization,
            burst_gap_s=self.burst_gap_s,
            seed=self.seed,
        )
        fields.update(overrides)
        return SimConfig(self.model, self.hardware, mode, pool, prefill_pool, **fields)


def layout_config(deployment: Deployment, mode: Mode, **overrides) -> SimConfig:
    """The single layout `simulate`'s layout options describe, for one mode."""
    layout = deployment.layout
    return deployment.config(
        mode,
        tp=layout.tp,
        num_workers=layout.num_workers,
        budget=layout.max_num_batched_tokens,
        prefill=(layout.num_prefill_workers, layout.prefill_tp or layout.tp),
        decode=(layout.num_decode_workers, layout.decode_tp or layout.tp),
        decode_budget=layout.decode_max_num_batched_tokens,
        local_prefill_threshold=layout.local_prefill_threshold,
        horizon_s=layout.horizon_s,
        autoscale=layout.autoscale if mode is Mode.DISAGG else None,
        **overrides,
    )


def sim_autoscale(args: argparse.Namespace) -> SimAutoscale | None:
    """The autoscaler `simulate --autoscale` runs (None without the flag)."""
    try:
        config = autoscale_config_from_args(args)
        if config is None:
            return None
        replay = load_decisions(args.autoscale_decisions) if args.autoscale_decisions else ()
        return SimAutoscale(config, args.worker_startup, args.role_switch_time, replay)
    except ValueError as exc:
        raise SimConfigError(str(exc)) from None


def load_decisions(path: Path) -> tuple[Decision, ...]:
    """--autoscale-decisions: a list of `Decision.to_dict`s, or an object with "decisions"."""
    try:
        data = json.loads(path.read_text())
        entries = data["decisions"] if isinstance(data, dict) else data
        return tuple(Decision.from_dict(entry) for entry in entries)
    except OSError as exc:
        raise SimConfigError(f"--autoscale-decisions: cannot read {path}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SimConfigError(
            f"--autoscale-decisions: {path} is not a list of decisions ({exc!r})"
        ) from None


def parse_modes(text: str) -> list[Mode]:
    try:
        return [Mode(m.strip()) for m in text.split(",") if m.strip()]
    except ValueError:
        raise SimConfigError(
            f"--mode: expected {', '.join(m.value for m in Mode)} (comma-separated), got {text!r}"
        ) from None


# ---- workloads -------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedWorkload:
    """The requests to simulate, and how the benchmark would describe them."""

    workload: Workload
    specs: list[SimRequestSpec]
    request_rate: float | None
    seed: int
    burstiness: float
    max_concurrency: int | None


def workload_from_args(
    args: argparse.Namespace, max_model_len: int, request_rate: float | None = None
) -> PlannedWorkload:
    """Build the requests; `request_rate` overrides --request-rate (plan's search)."""
    try:
        if args.workload_from:
            return _replayed(args)
        rate = request_rate if request_rate is not None else _single_rate(args.request_rate)
        workload = _workload(args, rate)
        specs = plan_requests(
            workload,
            seed=args.seed,
            request_rate=rate,
            burstiness=args.burstiness,
            max_model_len=max_model_len,
        )
        return PlannedWorkload(
            workload, specs, rate, args.seed, args.burstiness, args.max_concurrency
        )
    except BenchError as exc:
        raise SimConfigError(str(exc)) from None


def slos_from_text(items: list[str] | None) -> dict[str, float]:
    """`--goodput ttft:MS tpot:MS` or plan's `--slo ttft:MS,tpot:MS`."""
    parts = [p for item in items or [] for p in item.split(",") if p]
    try:
        return parse_goodput(parts)
    except BenchError as exc:
        raise SimConfigError(str(exc).replace("--goodput", "--slo")) from None


def _single_rate(text: str | None) -> float | None:
    if text is None:
        return None
    rates = parse_request_rates(text)
    if len(rates) != 1:
        raise SimConfigError("--request-rate: give one rate (plan searches rates itself)")
    return rates[0]


def _workload(args: argparse.Namespace, rate: float | None) -> Workload:
    """`pdserve bench`'s workload; --duration is a trace's window (as --trace-duration), or
    else the prompts `rate` sends in that long."""
    options = workload_options(args)
    if args.duration is not None and args.workload == "trace":
        options = replace(
            options, trace_window=replace(options.trace_window, duration_s=args.duration)
        )
    elif args.duration is not None and options.num_prompts is None:
        if rate is None or math.isinf(rate):
            raise SimConfigError("--duration needs a finite --request-rate")
        options = replace(options, num_prompts=max(1, math.ceil(rate * args.duration)))
    return make_workload(args.workload, options, seeded_rng(args.seed, TRACE_WINDOW_STREAM))


def _replayed(args: argparse.Namespace) -> PlannedWorkload:
    specs, config = specs_from_bench_result(args.workload_from)
    entries = tuple(
        TraceEntry(s.arrival_time, s.output_len, prompt_len=s.prompt_len) for s in specs
    )
    # The replayed run's concurrency cap unless the command line gives one.
    cap = args.max_concurrency or config.get("max_concurrency")
    return PlannedWorkload(
        TraceWorkload(entries),
        specs,
        None,
        int(config.get("seed", 0)),
        float(config.get("burstiness", 1.0)),
        cap,
    )
