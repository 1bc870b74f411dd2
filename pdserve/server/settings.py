"""The HTTP server's own settings (the engine's live in `engine.config.EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.config import DEFAULT_BURST_GAP_S
from pdserve.engine.async_engine import DEFAULT_HEALTH_TIMEOUT_S, DEFAULT_MAX_QUEUE


@dataclass(frozen=True)
class ServerSettings:
    """`served_model_names[0]` is reported by /v1/models and in responses; requests may name
    any of them. `api_key` None disables authentication. `fleet_secret`: this server is a
    deployment's worker and answers only its fleet (`pdserve.fleet`), whatever `api_key` says."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    fleet_secret: str | None = field(default=None, repr=False)
    max_queue: int = DEFAULT_MAX_QUEUE
    # An idle engine waits this long for a burst's next request before its first step.
    burst_gap_s: float = DEFAULT_BURST_GAP_S
    max_body_bytes: int = 4 * 2**20
    # On SIGTERM, in-flight requests get this long to finish before they are aborted.
    shutdown_grace_s: float = 5.0
    # /health turns 503 when the engine loop has not made progress for this long.
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must name at least one model")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        for name in ("max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.burst_gap_s < 0:
            raise ValueError(f"burst_gap_s must be >= 0, got {self.burst_gap_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.health_timeout_s <= 0:
            raise ValueError(f"health_timeout_s must be > 0, got {self.health_timeout_s}")
