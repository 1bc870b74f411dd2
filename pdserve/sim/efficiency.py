"""Fractions of peak reached in practice plus fixed costs: the cost model's free parameters.

Defaults are typical of well-tuned serving stacks on GPUs (large GEMMs at ~60% of peak
FLOP/s, streaming reads at ~80% of peak bandwidth); `pdserve simulate calibrate` replaces
them with a fit to measured step times and saves them as JSON.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pdserve.sim.errors import SimConfigError


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of each peak, and the per-step costs no roofline accounts for."""

    linear_compute: float = 0.6
    attention_compute: float = 0.5
    memory: float = 0.8
    network: float = 0.9
    # Scheduling, batch preparation, sampling, kernel launches: paid once per step.
    step_overhead_s: float = 2e-3
    # The part of that overhead that grows with the number of sequences in the batch.
    per_seq_overhead_s: float = 1e-5
    # Paid once per request before its first step: the front end's HTTP handling and
    # tokenization (the simulator admits each request this long after it is sent).
    request_overhead_s: float = 0.0
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
    # it (threads losing their core to the HTTP server or a KV transfer). Interruptions
    # average out over longer steps, so there the draw's deviation from 1 shrinks as
    # sqrt(jitter_step_s / step). Empty: every step takes exactly the modelled time.
    step_jitter: tuple[float, ...] = ()
    jitter_step_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear_compute", "attention_compute", "memory", "network"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise SimConfigError(f"efficiency {name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "per_seq_overhead_s", "request_overhead_s"):
            if getattr(self, name) < 0:
                raise SimConfigError(f"efficiency {name} must be >= 0")
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
            factor = 1 + (factor - 1) * math.sqrt(self.jitter_step_s / step_s)
        return factor

    def save(self, path: str | Path, **metadata: object) -> None:
        """Write the factors (and free-form provenance such as the fit error) as JSON."""
        Path(path).write_text(json.dumps({"efficiency": asdict(self), **metadata}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Efficiency:
        """Read factors written by `save` (extra metadata keys are ignored)."""
        try:
            data = json.loads(Path(path).read_text())["efficiency"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SimConfigError(
                f"--calibration: cannot read efficiency from {path}: {exc}"
            ) from None
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SimConfigError(f"--calibration: {path} has unknown keys {sorted(unknown)}")
        return cls(**data)


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


def default_efficiency(hardware_name: str) -> Efficiency:
    return CPU_DEFAULT if hardware_name.startswith("cpu-local") else Efficiency()
