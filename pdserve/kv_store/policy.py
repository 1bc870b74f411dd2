"""Fetch or recompute: a store hit is worth reading only when that beats recomputing it.

    fetch_s     = round_trip_s + num_bytes / bandwidth
    recompute_s = num_tokens / prefill_tokens_per_s

Both rates are exponentially weighted moving averages of this worker's measurements (store
round trips and fetches; prefill steps, fed by the engine), so the break-even follows the
real link and the real model: on a fast accelerator a short hit is recomputed, on a CPU
nearly every hit is fetched. Until a rate is measured its initial guess stands; with no
prefill measured yet a hit is fetched.
"""

from __future__ import annotations

import threading

# Weight of the newest measurement.
EWMA_WEIGHT = 0.2
INITIAL_BANDWIDTH = 1e9  # bytes/s: loopback Redis moves a few GB/s
INITIAL_ROUND_TRIP_S = 0.001


class FetchPolicy:
    def __init__(
        self,
        bandwidth: float = INITIAL_BANDWIDTH,
        round_trip_s: float = INITIAL_ROUND_TRIP_S,
        prefill_tokens_per_s: float | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.bandwidth = bandwidth
        self.round_trip_s = round_trip_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def observe_round_trip(self, seconds: float) -> None:
        with self._lock:
            self.round_trip_s = _ewma(self.round_trip_s, seconds)

    def observe_fetch(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        # The transfer's own time: what the round trip does not explain (at least 10%).
        transfer_s = max(seconds - self.round_trip_s, 0.1 * seconds)
        with self._lock:
            self.bandwidth = _ewma(self.bandwidth, num_bytes / transfer_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        with self._lock:
            previous = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if previous is None else _ewma(previous, rate)

    def fetch_seconds(self, num_bytes: int) -> float:
        return self.round_trip_s + num_bytes / self.bandwidth

    def recompute_seconds(self, num_tokens: int) -> float | None:
        rate = self.prefill_tokens_per_s
        return None if rate is None else num_tokens / rate

    def should_fetch(self, num_tokens: int, num_bytes: int) -> bool:
        recompute_s = self.recompute_seconds(num_tokens)
        return recompute_s is None or self.fetch_seconds(num_bytes) < recompute_s


def _ewma(average: float, sample: float) -> float:
    return (1 - EWMA_WEIGHT) * average + EWMA_WEIGHT * sample
