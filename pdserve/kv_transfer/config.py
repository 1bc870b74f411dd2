"""`KVTransferConfig`: how a worker takes part in KV transfer (vLLM-like names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.kv_transfer.registry import TRANSPORTS


class KVRole(enum.Enum):
    PRODUCER = "kv_producer"  # prefill worker: leases blocks and serves them
    CONSUMER = "kv_consumer"  # decode worker: fetches blocks into its cache
    BOTH = "kv_both"


@dataclass(frozen=True)
class KVTransferConfig:
    """`kv_host`/`kv_port`: where a producer's KV server binds (port 0: any free port);
    `kv_advertise_host`: the address put in kv_transfer_params (default `kv_host`).
    `kv_lease_timeout`: seconds a producer holds unfetched blocks; `kv_transfer_timeout`:
    a consumer's socket timeout per operation; `kv_idle_timeout`: a producer drops
    connections silent this long. `kv_node_id`: the node this worker runs on, for
    ``transport="auto"`` (None: this host). `secret`: the deployment's fleet secret, which
    every KV connection must prove (None: an open KV server, as on one host)."""

    # Shared memory: the one-host deployment; workers on other hosts need tcp.
    transport: str = "shm"
    kv_role: KVRole = KVRole.BOTH
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_advertise_host: str | None = None
    kv_lease_timeout: float = 30.0
    kv_transfer_timeout: float = 10.0
    kv_idle_timeout: float = 300.0
    engine_id: str | None = None
    kv_node_id: str | None = None
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.kv_role, str):
            object.__setattr__(self, "kv_role", KVRole(self.kv_role))
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {self.transport!r}")
        if self.secret == "":
            raise ValueError("secret must not be empty")
        if not (isinstance(self.kv_port, int) and 0 <= self.kv_port <= 65535):
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port!r}")
        for name in ("kv_lease_timeout", "kv_transfer_timeout", "kv_idle_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in (KVRole.CONSUMER, KVRole.BOTH)

    @property
    def needs_shared_cache(self) -> bool:
        """Whether the engine's KV cache must live in shared memory (receivers on this host
        copy straight out of it)."""
        return TRANSPORTS[self.transport].needs_shared_cache

    @property
    def advertise_host(self) -> str:
        return self.kv_advertise_host or self.kv_host
