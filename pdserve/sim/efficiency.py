"""Fractions of peak reached in practice plus fixed costs: the cost model's free parameters.

Defaults are typical of well-tuned serving stacks on GPUs (large GEMMs at ~60% of peak
FLOP/s, streaming reads at ~80% of peak bandwidth); `pdserve simulate calibrate` replaces
them with a fit to measured step times and saves them as JSON.
"""

from __future__ import annotations

import json
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

    def __post_init__(self) -> None:
        for name in ("linear_compute", "attention_compute", "memory", "network"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise SimConfigError(f"efficiency {name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "per_seq_overhead_s"):
            if getattr(self, name) < 0:
                raise SimConfigError(f"efficiency {name} must be >= 0")

    def save(self, path: str | Path, **metadata: object) -> None:
        """Write the factors (and free-form provenance such as the fit error) as JSON."""
        Path(path).write_text(json.dumps({"efficiency": asdict(self), **metadata}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Efficiency:
        """Read factors written by `save` (extra metadata keys are ignored)."""
        try:
            data = json.loads(Path(path).read_text())["efficiency"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SimConfigError(f"--calibration: cannot read efficiency from {path}: "
                                 f"{exc}") from None
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SimConfigError(f"--calibration: {path} has unknown keys {sorted(unknown)}")
        return cls(**data)


# The local CPU before calibration: AMX matmuls reach a fraction of their peak, and a
# Python engine step costs milliseconds.
CPU_DEFAULT = Efficiency(linear_compute=0.3, attention_compute=0.1, memory=0.7, network=0.5,
                         step_overhead_s=5e-3, per_seq_overhead_s=2e-4)


def default_efficiency(hardware_name: str) -> Efficiency:
    return CPU_DEFAULT if hardware_name.startswith("cpu-local") else Efficiency()
