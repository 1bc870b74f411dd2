"""What one simulation runs: model, hardware, the layout of worker pools, and knobs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.core.config import DEFAULT_BURST_GAP_S, CacheConfig, Mode, SchedulerConfig
from pdserve.router.autoscale.config import AutoscaleConfig
from pdserve.router.autoscale.planner import Decision
from pdserve.router.config import RouterConfig
from pdserve.sim.efficiency import Efficiency, default_efficiency
from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import Hardware
from pdserve.sim.model_spec import ModelSpec
from pdserve.sim.network import Interconnect, get_network

# What a worker of this engine takes to become healthy and to switch pools, as measured on
# the CPU machines here (benchmarks/autoscale.py reports both).
DEFAULT_STARTUP_S = 8.0
DEFAULT_SWITCH_S = 0.01


@dataclass(frozen=True)
class SimAutoscale:
    """The autoscaler a simulation runs, and how long its fleet changes take."""

    config: AutoscaleConfig
    startup_s: float = DEFAULT_STARTUP_S
    switch_s: float = DEFAULT_SWITCH_S
    # Decisions to make at their times instead of the planner's (`AutoscaleController`'s
    # replay; --autoscale-decisions): the simulator judged on a live run's path.
    replay: tuple[Decision, ...] = ()

    def __post_init__(self) -> None:
        if self.startup_s < 0 or self.switch_s < 0:
            raise ValueError("worker startup and switch times must be >= 0")


@dataclass(frozen=True)
class PoolConfig:
    """`num_workers` engine instances of `tp` devices each, scheduled by the real core
    scheduler with `scheduler_config`."""

    num_workers: int
    tp: int
    scheduler_config: SchedulerConfig

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.tp < 1:
            raise SimConfigError(
                f"a pool needs >= 1 worker of >= 1 device, got {self.num_workers} × tp {self.tp}"
            )

    @property
    def num_devices(self) -> int:
        return self.num_workers * self.tp


@dataclass(frozen=True)
class SimConfig:
    """A simulated deployment. In colocated/chunked mode `pool` is the only pool; in disagg
    mode `pool` decodes and `prefill_pool` prefills."""

    model: ModelSpec
    hardware: Hardware
    mode: Mode
    pool: PoolConfig
    prefill_pool: PoolConfig | None = None
    # Link between nodes (KV transfers, TP across nodes).
    network: Interconnect = field(default_factory=lambda: get_network("ib-8x400"))
    # Every worker's KV cache, as the engine takes it: its block size and prefix caching,
    # and `num_blocks` per worker where given (e.g. to match a real engine).
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Without `cache.num_blocks`: True sizes each worker's cache to what its devices' memory
    # holds after the weights (× `memory_utilization`); False to `cache.kv_cache_memory_gb`
    # per worker, as the engine does.
    is_kv_cache_from_memory: bool = True
    # The router in front, as `pdserve router` takes it: its policies, (disagg) its
    # local_prefill_threshold and kv_handoff (pulled after the prefill, or streamed chunk by
    # chunk during it: only what the link cannot hide is on the TTFT, `sim/handoff.py`), and
    # its health_interval_s, how often it reads the workers' load gauges. Its block_size is
    # the workers'.
    router: RouterConfig = field(default_factory=lambda: RouterConfig((), ()))
    efficiency: Efficiency | None = None
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    memory_utilization: float = 0.9
    # Client-side cap on requests in flight (the benchmark's --max-concurrency).
    max_concurrency: int | None = None
    # An idle worker waits this long for a burst's next request (the server's --burst-gap).
    burst_gap_s: float = DEFAULT_BURST_GAP_S
    # Stop the clock here; requests still in flight are reported incomplete.
    horizon_s: float | None = None
    # Seeds the step-time jitter draws of a calibrated `efficiency`.
    seed: int = 0
    # Disagg: the router's autoscaler resizes the pools as the run goes (None: fixed pools).
    autoscale: SimAutoscale | None = None

    def __post_init__(self) -> None:
        if (self.mode is Mode.DISAGG) != (self.prefill_pool is not None):
            raise SimConfigError(
                "--prefill-workers/--decode-workers go with --mode disagg (and only with it)"
            )
        if not 0 < self.memory_utilization <= 1:
            raise SimConfigError("--memory-utilization must be in (0, 1]")
        if self.router.block_size != self.cache.block_size:
            raise SimConfigError(
                f"the router's block_size {self.router.block_size} is not the workers' "
                f"{self.cache.block_size}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise SimConfigError("--max-concurrency must be >= 1")
        if self.burst_gap_s < 0:
            raise SimConfigError(f"--burst-gap must be >= 0, got {self.burst_gap_s}")
        if self.autoscale is not None and self.mode is not Mode.DISAGG:
            raise SimConfigError("--autoscale sizes the pools of --mode disagg")
        if self.mode is not Mode.DISAGG:
            expected = self.mode.scheduling
            if self.pool.scheduler_config.scheduling is not expected:
                raise SimConfigError(
                    f"mode {self.mode.value} needs a {expected.value} scheduler config"
                )

    @property
    def num_devices(self) -> int:
        prefill = self.prefill_pool.num_devices if self.prefill_pool else 0
        return self.pool.num_devices + prefill

    @property
    def resolved_efficiency(self) -> Efficiency:
        return self.efficiency or default_efficiency(self.hardware.name)

    def describe(self) -> str:
        """A short layout label, e.g. "chunked 8×TP8 budget 2048" or "disagg 2×TP8:6×TP8"."""
        pool = self.pool
        if self.mode is Mode.DISAGG:
            pre = self.prefill_pool
            label = f"disagg {pre.num_workers}×TP{pre.tp}:{pool.num_workers}×TP{pool.tp}"
            if self.router.local_prefill_threshold:
                label += f" local<{self.router.local_prefill_threshold}"
            budget = pool.scheduler_config.max_num_batched_tokens
            if budget != pre.scheduler_config.max_num_batched_tokens:
                label += f" decode budget {budget}"
            if self.autoscale is not None:
                label += " autoscaled"
            return label
        label = f"{self.mode.value} {pool.num_workers}×TP{pool.tp}"
        if self.mode is Mode.CHUNKED:
            label += f" budget {pool.scheduler_config.max_num_batched_tokens}"
        return label


def scheduler_config_for(mode: Mode, *fields, **named_fields) -> SchedulerConfig:
    """The core scheduler config a worker of `mode` runs (disagg workers chunk): `fields` are
    `SchedulerConfig`'s after `scheduling` (`max_num_batched_tokens`, `max_num_seqs`,
    `max_model_len`, ...), with its defaults."""
    return SchedulerConfig(mode.scheduling, *fields, **named_fields)


def with_scheduler(pool: PoolConfig, **changes) -> PoolConfig:
    """`pool` with some scheduler fields changed."""
    return replace(pool, scheduler_config=replace(pool.scheduler_config, **changes))
