"""Fractions of peak reached in practice plus fixed costs: the cost model's free parameters,
and the calibrations that set them.

`Efficiency()`'s defaults are typical of well-tuned serving stacks on GPUs (large GEMMs at
~60% of peak FLOP/s, streaming reads at ~80% of peak bandwidth). A `Calibration` is an
efficiency fitted to measurements (`pdserve simulate calibrate`, or the published profiles
shipped in `sim/data/calibrations/`, docs/calibrations.md) with the stack it describes and
the band its residuals imply; a GPU with a shipped calibration runs at it by default.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pdserve.sim.errors import SimConfigError

# The fixed costs a fit solves for, each paid per unit of what `Measurement` counts.
OVERHEADS = (
    "step_overhead_s",
    "per_seq_overhead_s",
    "request_overhead_s",
    "layer_overhead_s",
)
# The fixed costs every step with tokens pays once whatever its batch: indistinguishable from
# a linear-layer curve's constant, so a fit with a curve leaves them to the curve.
PER_STEP_OVERHEADS = ("step_overhead_s", "layer_overhead_s")
# The efficiencies a fit searches; one that ends at 1.0 (the peak) is at its bound.
FITTED_SHARES = ("linear_compute", "attention_compute", "memory")


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of each peak, and the per-step costs no roofline accounts for."""

    linear_compute: float = 0.6
    # FP8 GEMMs' share of the FP8 peak, where it differs from 16-bit ones' (None: the same).
    fp8_linear_compute: float | None = None
    attention_compute: float = 0.5
    memory: float = 0.8
    # On top of each link's own measured (or assumed) share of its line rate (sim/network).
    network: float = 1.0
    # Scheduling, batch preparation, sampling, kernel launches: paid once per step.
    step_overhead_s: float = 2e-3
    # The part of that overhead that grows with the number of sequences in the batch.
    per_seq_overhead_s: float = 1e-5
    # Paid once per request before its first step: the front end's HTTP handling and
    # tokenization (the simulator admits each request this long after it is sent).
    request_overhead_s: float = 0.0
    # Paid by each decoder layer in every step with tokens, the same at every TP degree and
    # batch: the layer's kernel launches and the short kernels between its GEMMs (norms,
    # rotary, activation, residual), which no roofline sees. Sharded kernels get shorter with
    # TP; this does not, which is why a fit without it scales a stack's fixed costs with TP.
    layer_overhead_s: float = 0.0
    # How sharply a kernel turns from memory- to compute-bound: None, the textbook roofline
    # (the larger of its compute and memory times); p, their p-norm. Measured GEMMs near the
    # ridge (as many rows as the GPU's FLOP/byte ratio) take up to ~1.3x the larger of the
    # two (p ≈ 3): weights stream while tiles compute, neither at its full rate.
    roofline_sharpness: float | None = None
    # KV bytes the attention kernel reads per step ÷ the visible cache's, capped at the
    # query heads sharing each KV head: 1 where grouped-query attention is exploited; up to
    # the group size where each query head reads its KV head again (TensorRT-LLM's masked
    # MHA kernel before its XQA kernels: a 70B GQA model's decode reads up to 8x its cache).
    kv_read_amplification: float = 1.0
    # Every modelled step × this: 1, except in the runs that bound a calibration's band.
    time_scale: float = 1.0
    # Measured linear-layer speed in place of the roofline: (rows, seconds per parameter)
    # knots, rows increasing; a layer of P parameters over M rows takes P × curve(M),
    # interpolated between knots and growing in proportion to M past the last. Kernels switch
    # with the row count (a GEMV below a few rows, blocked GEMMs above), which one efficiency
    # cannot follow (`sim/linear_curve.py`). Empty: the roofline.
    linear_curve: tuple[tuple[int, float], ...] = ()
    # Measured / modelled step time at evenly spaced probabilities 0..1 (ascending), over
    # steps of typically `jitter_step_s`: the simulator multiplies each step by a draw from
    # it (threads losing their core to the HTTP server or a KV transfer). Past
    # `jitter_step_s` the draw's deviation from 1 shrinks as (jitter_step_s / step) **
    # jitter_decay: 0.5 where interruptions are independent and average out over a longer
    # step, 0 where the machine's load lasts as long as the steps do (two engines, a router
    # and a client on two cores); fitted from the observations. Empty: every step takes
    # exactly the modelled time.
    step_jitter: tuple[float, ...] = ()
    jitter_step_s: float = 0.0
    jitter_decay: float = 0.5

    def __post_init__(self) -> None:
        factors = ("linear_compute", "fp8_linear_compute", "attention_compute", "memory")
        for name in (*factors, "network"):
            value = getattr(self, name)
            if value is None and name == "fp8_linear_compute":
                continue
            if not 0 < value <= 1:
                raise SimConfigError(f"efficiency {name} must be in (0, 1], got {value!r}")
        for name in OVERHEADS:
            if getattr(self, name) < 0:
                raise SimConfigError(f"efficiency {name} must be >= 0")
        if self.roofline_sharpness is not None and not self.roofline_sharpness >= 1:
            raise SimConfigError("efficiency roofline_sharpness must be >= 1 (or null: max)")
        if not self.kv_read_amplification >= 1:
            raise SimConfigError("efficiency kv_read_amplification must be >= 1")
        if not self.time_scale > 0:
            raise SimConfigError("efficiency time_scale must be positive")
        object.__setattr__(
            self, "linear_curve", tuple((int(m), float(t)) for m, t in self.linear_curve)
        )
        rows = [m for m, _ in self.linear_curve]
        if any(m < 1 for m in rows) or rows != sorted(set(rows)):
            raise SimConfigError("efficiency linear_curve rows must be positive and increasing")
        if any(not t > 0 for _, t in self.linear_curve):
            raise SimConfigError("efficiency linear_curve seconds must be positive")
        object.__setattr__(self, "step_jitter", tuple(float(q) for q in self.step_jitter))
        jitter = self.step_jitter
        if len(jitter) == 1 or any(not q > 0 for q in jitter) or list(jitter) != sorted(jitter):
            raise SimConfigError(
                "efficiency step_jitter must be at least 2 positive quantiles in ascending order"
            )
        if self.step_jitter and not self.jitter_step_s > 0:
            raise SimConfigError("efficiency jitter_step_s must be positive with step_jitter")
        if not 0 <= self.jitter_decay <= 1:
            raise SimConfigError("efficiency jitter_decay must be in [0, 1]")

    def linear_share(self, dtype: str) -> float:
        """The share of the peak a GEMM on weights stored in `dtype` reaches."""
        if dtype == "fp8" and self.fp8_linear_compute is not None:
            return self.fp8_linear_compute
        return self.linear_compute

    def draw_jitter(self, rng: random.Random, step_s: float) -> float:
        """A factor for a step modelled at `step_s`, drawn from `step_jitter` (1.0 without
        one)."""
        jitter = self.step_jitter
        if not jitter:
            return 1.0
        position = rng.random() * (len(jitter) - 1)
        index = min(int(position), len(jitter) - 2)
        fraction = position - index
        factor = jitter[index] + (jitter[index + 1] - jitter[index]) * fraction
        if step_s > self.jitter_step_s:
            factor = 1 + (factor - 1) * (self.jitter_step_s / step_s) ** self.jitter_decay
        return factor

    def save(self, path: str | Path, **metadata: object) -> None:
        """Write the factors (and free-form provenance such as the fit error) as JSON."""
        Path(path).write_text(json.dumps({"efficiency": asdict(self), **metadata}, indent=2))

    @classmethod
    def load(cls, spec: str | Path) -> Efficiency:
        """The factors of a calibration: a shipped one's name or a file `save` wrote."""
        return Calibration.load(spec).efficiency

    @classmethod
    def from_dict(cls, data: dict, where: str) -> Efficiency:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SimConfigError(f"--calibration: {where} has unknown keys {sorted(unknown)}")
        return cls(**data)


SHIPPED_DIR = Path(__file__).parent / "data" / "calibrations"


@dataclass(frozen=True)
class Calibration:
    """An efficiency with its provenance: the stack it describes, what it was fitted to, and
    `band`, the relative error its own fitting points imply (None: not calibrated).

    The file is `Efficiency.save`'s JSON; the keys beside "efficiency" are `metadata`
    ("stack", "sources", "points" with their residuals, "default_for" hardware names).
    """

    name: str
    efficiency: Efficiency
    band: float | None = None
    metadata: dict = field(default_factory=dict, compare=False)

    @property
    def stack(self) -> str:
        return self.metadata.get("stack", "")

    def describe(self) -> str:
        """One line: the name, the stack, the band."""
        band = "no band: uncalibrated" if self.band is None else f"band ±{self.band:.0%}"
        served = self.metadata.get("bands", {}).get("served")
        if served is not None:
            band += f"; a served stack under load ±{served:.0%}, its held-out check"
        # A shipped calibration's by kind of source; a fitted one's in its fit statistics.
        by_kind = self.metadata.get("at_bound", {})
        bound = [n for names in by_kind.values() for n in names]
        bound += self.metadata.get("fit", {}).get("at_bound", [])
        if bound:
            band += f"; at 100% of peak: {', '.join(bound)}"
        summary = self.metadata.get("summary") or self.stack
        return f"{self.name} ({summary}; {band})"

    def save(self, path: str | Path) -> None:
        self.efficiency.save(path, name=self.name, band=self.band, **self.metadata)

    @classmethod
    def load(cls, spec: str | Path) -> Calibration:
        """A shipped calibration by name (`shipped_calibrations`) or a calibration file."""
        path = Path(spec)
        if not path.is_file() and (SHIPPED_DIR / f"{spec}.json").is_file():
            return _shipped(str(spec))
        return cls._read(path)

    @classmethod
    def _read(cls, path: Path) -> Calibration:
        try:
            data = json.loads(path.read_text())
            efficiency = Efficiency.from_dict(data.pop("efficiency"), str(path))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise SimConfigError(
                f"--calibration: cannot read a calibration from {path} (a file written by "
                f"`pdserve simulate calibrate`, or one of {', '.join(shipped_calibrations())}):"
                f" {exc}"
            ) from None
        name = data.pop("name", path.stem)
        band = data.pop("band", None)
        return cls(name, efficiency, None if band is None else float(band), data)


@functools.cache
def _shipped(name: str) -> Calibration:
    return Calibration._read(SHIPPED_DIR / f"{name}.json")


def shipped_calibrations() -> list[str]:
    """Names of the calibrations that ship with pdserve (docs/calibrations.md)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


# The local CPU before calibration: matmuls reach a fraction of the nominal peak, and a
# Python engine step costs milliseconds.
CPU_DEFAULT = Efficiency(
    linear_compute=0.3,
    attention_compute=0.1,
    memory=0.7,
    network=0.5,
    step_overhead_s=5e-3,
    per_seq_overhead_s=2e-4,
)


def default_calibration(hardware_name: str) -> Calibration:
    """What a device runs at unless told otherwise: the shipped calibration made its
    default, else the local CPU's or typical GPU defaults (no band)."""
    if hardware_name.startswith("cpu-local"):
        return Calibration("cpu-default", CPU_DEFAULT, metadata={"stack": "uncalibrated CPU"})
    for name in shipped_calibrations():
        calibration = _shipped(name)
        if hardware_name in calibration.metadata.get("default_for", ()):
            return calibration
    return Calibration("typical", Efficiency(), metadata={"stack": "typical GPU defaults"})


def calibration_for(spec: str | None, hardware_name: str) -> Calibration:
    """What `--calibration SPEC` means on `hardware_name`: that calibration (a shipped name or
    a file), or without one the device's default."""
    return Calibration.load(spec) if spec else default_calibration(hardware_name)


def default_efficiency(hardware_name: str) -> Efficiency:
    return default_calibration(hardware_name).efficiency
