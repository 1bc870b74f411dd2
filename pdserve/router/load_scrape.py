"""Read a worker's load gauges out of its Prometheus text exposition.

Only three gauges matter to routing, so this scans lines for their names instead of parsing
the whole exposition (a worker's /metrics holds many histograms; this runs every few seconds
per worker on the same cores the workers use). Samples of one gauge with different labels are
summed.
"""

from __future__ import annotations

import math

from pdserve.router.worker import ScrapedLoad

RUNNING_GAUGE = "pdserve:num_requests_running"
WAITING_GAUGE = "pdserve:num_requests_waiting"
KV_USAGE_GAUGE = "pdserve:kv_cache_usage_perc"
_GAUGES = (RUNNING_GAUGE, WAITING_GAUGE, KV_USAGE_GAUGE)


def parse_worker_load(text: str) -> ScrapedLoad:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("pdserve:"):
            continue
        for name in _GAUGES:
            value = _sample_value(line, name)
            if value is not None:
                totals[name] = totals.get(name, 0.0) + value
                break
    running, waiting = totals.get(RUNNING_GAUGE), totals.get(WAITING_GAUGE)
    return ScrapedLoad(
        num_running=None if running is None else round(running),
        num_waiting=None if waiting is None else round(waiting),
        kv_cache_usage=totals.get(KV_USAGE_GAUGE),
    )


def _sample_value(line: str, name: str) -> float | None:
    """The value of a sample line ``name{labels} value [timestamp]`` of metric `name`."""
    if not line.startswith(name):
        return None
    rest = line[len(name) :]
    if rest.startswith("{"):
        close = rest.rfind("}")
        if close < 0:
            return None
        rest = rest[close + 1 :]
    elif not rest.startswith(" "):
        return None  # a longer name sharing the prefix
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None
