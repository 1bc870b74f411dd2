"""Serving metrics with `vllm bench serve`'s definitions and key names.

TTFT: first content chunk − send. ITL: gaps between consecutive content chunks, pooled over
requests. TPOT: (E2EL − TTFT) / (output tokens − 1), requests with more than one token.
E2EL: last content chunk − send. Goodput: requests per second meeting every given SLO; SLO
attainment: the share of requests that do. Besides vLLM's TTFT, TPOT and E2EL SLOs, `max_itl`
bounds a request's longest gap: TPOT averages a 10 s freeze over a long answer, a stream that
froze for 10 s did not meet a stall SLO. Throughputs are over the wall time from the first
send to the last completion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pdserve.workload.errors import BenchError
from pdserve.workload.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el", "max_itl")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """Parse `--goodput ttft:MS tpot:MS e2el:MS max_itl:MS` into {metric: milliseconds}."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise BenchError(
                f"--goodput: expected METRIC:MS with METRIC in {', '.join(SLO_METRICS)}, "
                f"got {item!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not slos[name] > 0:
            raise BenchError(f"--goodput {item!r}: the limit must be > 0 ms")
    return slos


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of one latency metric, milliseconds (all 0 when there is no data)."""

    mean: float
    median: float
    std: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=float) * 1000.0
        p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            float(p90),
            float(p99),
            float(ms.max()),
        )

    def to_vllm_dict(self, metric: str) -> dict[str, float]:
        out = {
            f"mean_{metric}_ms": self.mean,
            f"median_{metric}_ms": self.median,
            f"std_{metric}_ms": self.std,
        }
        out.update({f"p{p}_{metric}_ms": getattr(self, f"p{p}") for p in PERCENTILES})
        out[f"max_{metric}_ms"] = self.max
        return out


@dataclass(frozen=True)
class BenchMetrics:
    """The run's aggregate numbers. `request_goodput`, `num_good` and `slo_attainment` are
    None when no SLO was given."""

    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    request_goodput: float | None
    num_good: int | None
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution

    @property
    def slo_attainment(self) -> float | None:
        """Share of the run's requests (failed ones included) that met every SLO."""
        if self.num_good is None:
            return None
        total = self.completed + self.failed
        return self.num_good / total if total else 0.0

    def to_vllm_dict(self) -> dict:
        out = {
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "duration": self.duration,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for metric in LATENCY_METRICS:
            out.update(getattr(self, metric).to_vllm_dict(metric))
        return out


def wall_time(records: list[RequestRecord]) -> float:
    """Seconds from the first send to the last completion (0 when nothing was sent)."""
    sends = [r.send_time for r in records if r.send_time is not None]
    ends = [r.end_time for r in records if r.end_time is not None]
    if not sends or not ends:
        return 0.0
    return max(ends) - min(sends)


def slo_values(record: RequestRecord) -> dict[str, float]:
    """What a successful request's SLOs are checked against, milliseconds per SLO_METRICS."""
    return {
        "ttft": record.ttft * 1000.0,
        "tpot": (record.tpot or 0.0) * 1000.0,
        "e2el": record.e2el * 1000.0,
        "max_itl": max(record.itls, default=0.0) * 1000.0,
    }


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a request succeeded and met every SLO (milliseconds)."""
    if not record.success:
        return False
    observed = slo_values(record)
    return all(observed[name] <= limit for name, limit in slos.items())


def has_missed_slos(record: RequestRecord, slos: Mapping[str, float], now: float) -> bool:
    """Whether a request, finished or still streaming at `now` (seconds, the records' clock),
    has already missed an SLO whatever happens next. Requests not sent yet have not."""
    if record.error is not None:
        return True
    if record.send_time is None:
        return False
    if record.end_time is not None:
        return not meets_slos(record, slos)
    # Lower bounds on what the request's values will be; it asked for `output_len` tokens.
    times = record.token_times
    bounds = {"e2el": now - record.send_time}
    if not times:
        bounds["ttft"] = bounds["e2el"]
    else:
        bounds["ttft"] = times[0] - record.send_time
        bounds["max_itl"] = max([*record.itls, now - times[-1]])
        if record.output_len > 1:
            bounds["tpot"] = (now - times[0]) / (record.output_len - 1)
    return any(bounds.get(name, 0.0) * 1000.0 > limit for name, limit in slos.items())


def compute_metrics(records: list[RequestRecord], slos: Mapping[str, float]) -> BenchMetrics:
    """Aggregate per-request records into the run's metrics."""
    done = [r for r in records if r.success]
    duration = wall_time(records)
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.num_output_tokens for r in done)
    num_good = sum(meets_slos(r, slos) for r in records) if slos else None
    return BenchMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration=duration,
        request_throughput=_per_second(len(done), duration),
        request_goodput=None if num_good is None else _per_second(num_good, duration),
        num_good=num_good,
        output_throughput=_per_second(total_out, duration),
        total_token_throughput=_per_second(total_in + total_out, duration),
        ttft=Distribution.of_seconds([r.ttft for r in done]),
        tpot=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itls]),
        e2el=Distribution.of_seconds([r.e2el for r in done]),
    )


def _per_second(count: float, duration: float) -> float:
    return count / duration if duration > 0 and math.isfinite(duration) else 0.0
