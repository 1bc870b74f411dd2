"""The KV transports by name: what `--kv-transport NAME` makes, and which names a sender may
offer in `kv_transfer_params.transport`.

Torch-free and importing nothing else of the package, so the config, the hand-off schema and
the command line read it; a transport's own module (torch) is imported only when a worker
makes one (`kv_transfer.connector.transport_over`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransportEntry:
    """`module.class_name`, a `KVTransport` subclass whose `name` is the registered one.

    `needs_shared_cache`: the engine's KV cache must live in shared memory (its constructor
    takes the `SharedKVCache`, not the tensor). `is_offered`: a sender names it in its
    hand-off (False for a receiver's choice per sender, as "auto", whose senders offer
    "shm")."""

    module: str
    class_name: str
    needs_shared_cache: bool
    is_offered: bool = True


# Every transport by its command-line name, in help order.
TRANSPORTS: dict[str, TransportEntry] = {}


def register_transport(name: str, entry: TransportEntry) -> None:
    """Make `entry`'s transport the one `--kv-transport NAME` makes."""
    if name in TRANSPORTS:
        raise ValueError(f"KV transport {name!r} is registered already")
    TRANSPORTS[name] = entry


def offered_transports() -> tuple[str, ...]:
    """The names a sender may put in `kv_transfer_params.transport`."""
    return tuple(name for name, entry in TRANSPORTS.items() if entry.is_offered)


# Shared memory: the one-host deployment; workers on other hosts need tcp.
register_transport("shm", TransportEntry("pdserve.kv_transfer.shm", "ShmTransport", True))
register_transport("tcp", TransportEntry("pdserve.kv_transfer.transport", "TcpTransport", False))
# Chosen per pair: shared memory with a sender on this worker's node, tcp with the others.
register_transport(
    "auto", TransportEntry("pdserve.kv_transfer.shm", "AutoTransport", True, is_offered=False)
)
