"""One worker as the router sees it: address, health, drain flag, in-flight and scraped load."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.policies import PoolRole, WorkerLoad


class WorkerState(enum.Enum):
    # Not checked yet: out of rotation until its first health check passes.
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    # Circuit open: failed health checks or a broken connection; back on a passing check.
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True)
class ScrapedLoad:
    """Gauges read from the worker's /metrics (`pdserve:*`); None where it does not export one."""

    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None


@dataclass
class Worker:
    worker_id: str
    url: str
    role: PoolRole
    state: WorkerState = WorkerState.UNKNOWN
    # Draining: takes no new requests; removed once `num_inflight` reaches 0.
    is_draining: bool = False
    num_consecutive_failures: int = 0
    last_error: str | None = None
    num_inflight: int = 0
    num_inflight_prefill_tokens: int = 0
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)

    @property
    def is_routable(self) -> bool:
        return self.state is WorkerState.HEALTHY and not self.is_draining

    def load(self, num_cached_tokens: int = 0) -> WorkerLoad:
        """The policy's view. Sequences are the larger of the scraped count and the router's
        own in-flight count: the scrape is seconds old, the in-flight count is exact but
        misses requests that reached the worker some other way."""
        scraped = self.scraped
        return WorkerLoad(
            num_running=max(scraped.num_running or 0, self.num_inflight),
            num_waiting=scraped.num_waiting or 0,
            num_pending_prefill_tokens=self.num_inflight_prefill_tokens,
            kv_cache_usage=scraped.kv_cache_usage or 0.0,
            num_cached_tokens=num_cached_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        """The record `GET /workers` returns."""
        return {
            "id": self.worker_id,
            "url": self.url,
            "role": self.role.value,
            "state": self.state.value,
            "draining": self.is_draining,
            "num_inflight": self.num_inflight,
            "num_inflight_prefill_tokens": self.num_inflight_prefill_tokens,
            "num_running": self.scraped.num_running,
            "num_waiting": self.scraped.num_waiting,
            "kv_cache_usage": self.scraped.kv_cache_usage,
            "last_error": self.last_error,
        }
