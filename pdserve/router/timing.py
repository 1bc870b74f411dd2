"""Per-request timing breakdown: the router's own clocks plus the decode worker's report.

The router sends the decode leg a ``router_timing`` object (``router_queue_ms``,
``prefill_ms``) for the worker to echo. The decode worker's final usage chunk (streaming) or
response body (non-streaming) carries ``pdserve_timing``, at the top level or inside ``usage``;
the router reads ``kv_transfer_bytes``, ``kv_transfer_ms`` and ``first_decode_step_ms`` from it
for its histograms (`RouterMetrics.observe`) and passes everything through.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

TIMING_HEADER = "x-pdserve-timing"


class Route(enum.Enum):
    # Prefill worker computed the prompt; its KV moved to the decode worker.
    REMOTE = "remote"
    # Uncached prompt below --local-prefill-threshold (or no prefill worker): decode prefills.
    LOCAL = "local"
    # The prefill leg failed (twice, or no usable KV params): decode prefills.
    LOCAL_FALLBACK = "local_fallback"


def now_ms() -> float:
    return time.perf_counter() * 1e3


@dataclass
class RequestTiming:
    request_id: str
    arrival_ms: float = field(default_factory=now_ms)
    route: Route | None = None
    router_queue_ms: float | None = None
    prefill_ms: float | None = None
    num_prefill_attempts: int = 0
    prefill_worker: str | None = None
    decode_worker: str | None = None
    # Prompt tokens the index said the worker computing the prompt had cached, and those it
    # then found (its prefix cache plus the shared store), as it reports them.
    predicted_hit_tokens: int | None = None
    hit_tokens: int | None = None
    # Router-side: arrival to the first byte of the decode worker's body, and to its end.
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    worker: dict[str, Any] = field(default_factory=dict)

    def mark_dispatched(self) -> None:
        """The first leg is about to be sent: routing (tokenize, select) is over."""
        self.router_queue_ms = now_ms() - self.arrival_ms

    def mark_first_byte(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = now_ms() - self.arrival_ms

    def mark_done(self) -> None:
        self.e2e_ms = now_ms() - self.arrival_ms

    def router_timing_field(self) -> dict[str, float]:
        """The ``router_timing`` object sent with the decode leg."""
        field = {
            "router_queue_ms": _round(self.router_queue_ms or 0.0),
            "prefill_ms": _round(self.prefill_ms or 0.0),
        }
        if self.predicted_hit_tokens is not None:
            field["predicted_hit_tokens"] = self.predicted_hit_tokens
        return field

    def take_worker_report(self, report: dict[str, Any]) -> None:
        """The decode worker's ``pdserve_timing``; when it computed the prompt (a local
        prefill) its hit tokens are the real ones."""
        self.worker.update(report)
        if self.route is Route.REMOTE:
            return
        hits = [report.get(k) for k in ("prefix_cache_hit_tokens", "kv_store_hit_tokens")]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in hits):
            self.hit_tokens = sum(hits)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "request_id": self.request_id,
            "route": None if self.route is None else self.route.value,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "num_prefill_attempts": self.num_prefill_attempts,
            **self.router_timing_field(),
        }
        if self.hit_tokens is not None:
            data["hit_tokens"] = self.hit_tokens
        for key in ("ttft_ms", "e2e_ms"):
            if getattr(self, key) is not None:
                data[key] = _round(getattr(self, key))
        data.update({k: v for k, v in self.worker.items() if k not in data})
        return data

    def header_value(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def extract_worker_timing(payload: Any) -> dict[str, Any] | None:
    """``pdserve_timing`` from a response body or SSE chunk, wherever the worker put it."""
    if not isinstance(payload, dict):
        return None
    timing = payload.get("pdserve_timing")
    if timing is None and isinstance(payload.get("usage"), dict):
        timing = payload["usage"].get("pdserve_timing")
    return timing if isinstance(timing, dict) else None


def _round(value: float) -> float:
    return round(value, 3)
