"""When each request is sent: Poisson, gamma (bursty) or all at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.workload.errors import BenchError


@dataclass(frozen=True)
class ArrivalProcess:
    """Request arrivals at a mean `request_rate` per second.

    Gaps between arrivals are gamma distributed with shape `burstiness` and mean
    1 / request_rate: burstiness 1 is a Poisson process, below 1 is burstier, above 1 is
    more regular. An infinite rate sends every request at time 0.
    """

    request_rate: float = math.inf
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise BenchError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchError(f"--burstiness must be a positive number, got {self.burstiness}")

    @property
    def kind(self) -> str:
        if math.isinf(self.request_rate):
            return "all-at-once"
        return "poisson" if self.burstiness == 1.0 else "gamma"

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        """Arrival times in seconds from the start, first at 0, non-decreasing; shape [N]."""
        if num_requests == 0 or math.isinf(self.request_rate):
            return np.zeros(num_requests)
        scale = 1.0 / (self.request_rate * self.burstiness)
        gaps = rng.gamma(shape=self.burstiness, scale=scale, size=num_requests - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])


def parse_request_rates(text: str) -> list[float]:
    """Parse `--request-rate`: one rate, `inf`, or a comma-separated sweep like `0.5,1,2,4`."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise BenchError(f"--request-rate: {part!r} is not a number or 'inf'") from None
        if not rate > 0:
            raise BenchError(f"--request-rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates
