"""The router's frozen, validated configuration."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pdserve.core.config import CacheConfig
from pdserve.fleet import FleetTLS
from pdserve.router.policies import POLICIES


def normalize_worker_url(url: str, where: str = "worker url") -> str:
    """``http(s)://host:port`` without a trailing slash; raises ValueError naming `where`."""
    if not isinstance(url, str):
        raise ValueError(f"{where} must be a string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: expected http://host:port, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"{where}: bad port in {url!r}") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{where}: expected no path or query, got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


class KVHandoff(enum.Enum):
    """How a decode worker gets a prefill worker's KV (docs/architecture.md)."""

    PULL = "pull"  # fetched after the prefill leg answered
    STREAM = "stream"  # received chunk by chunk while the prefill worker computes


@dataclass(frozen=True)
class RouterConfig:
    """Everything `pdserve router` is started with.

    `local_prefill_threshold`: prompts whose uncached length (prompt tokens minus the prefix the
    chosen decode worker's KV events say it has cached) is below it skip the prefill worker.
    0 sends every prompt through a prefill worker. `kv_handoff`: pull the KV after the prefill
    leg answered, or stream it (the prefill leg announces where its KV appears before
    computing, and the decode leg starts at once). `fleet_secret`: the deployment's
    (`pdserve.fleet`), presented to the workers on every leg; None for open workers.
    `fleet_tls`: the router's `--fleet-tls` credentials: every connection to a worker (its
    HTTPS API, a KV port) is mutual TLS under the deployment's CA. Without
    `decode_urls` the workers come from a discovery (`RouterRuntime`'s).
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_loaded"
    local_prefill_threshold: int = 0
    kv_handoff: KVHandoff = KVHandoff.PULL
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # Must equal the workers' --block-size for prefix matching to mean anything.
    block_size: int = CacheConfig.block_size
    # The workers share a KV store (--kv-store): a prefix the store holds (per the store
    # events the workers publish) counts as cached on all of them (for prefix_aware and
    # local_prefill_threshold alike).
    shared_kv_store: bool = False
    # prefix_aware leaves the best-matching worker when its load exceeds this times the least.
    balance_factor: float = 2.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    # Consecutive failed health checks that take a worker out of rotation.
    unhealthy_threshold: int = 2
    connect_timeout_s: float = 5.0
    # Upper bound on one leg (None: no bound; a stream may run as long as it generates).
    request_timeout_s: float | None = None
    max_body_bytes: int = 16 << 20
    fleet_secret: str | None = field(default=None, repr=False)
    fleet_tls: FleetTLS | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "prefill_urls",
            tuple(normalize_worker_url(u, "--prefill") for u in self.prefill_urls),
        )
        object.__setattr__(
            self,
            "decode_urls",
            tuple(normalize_worker_url(u, "--decode") for u in self.decode_urls),
        )
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(
                    f"--{name.replace('_', '-')}: unknown policy "
                    f"{getattr(self, name)!r}; known: {', '.join(POLICIES)}"
                )
        _at_least("local_prefill_threshold", self.local_prefill_threshold, 0)
        _at_least("port", self.port, 0)
        _at_least("block_size", self.block_size, 1)
        _at_least("unhealthy_threshold", self.unhealthy_threshold, 1)
        _at_least("max_body_bytes", self.max_body_bytes, 1)
        if self.balance_factor < 1.0:
            raise ValueError(f"--balance-factor must be >= 1, got {self.balance_factor}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        if self.fleet_secret == "":
            raise ValueError("fleet_secret must not be empty")

    @property
    def needs_token_ids(self) -> bool:
        """Whether routing needs the prompt's token ids (threshold or prefix matching)."""
        return self.local_prefill_threshold > 0 or "prefix_aware" in (
            self.prefill_policy,
            self.decode_policy,
        )


def _at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
