"""Ports for the servers a launcher starts: drawn free now, bound by a child process later.

A leaf module (the standard library only), so the launchers, the shared store's server, the
benchmarks and the tests draw ports one way.

Drawn below the kernel's ephemeral range: a port the kernel picks (bind to 0) lies inside it,
and so is also some outgoing connection's source port at any moment (Linux hands `connect()`
the even ones, so a free odd port's successor is exactly such a port); a server binding it
later fails with EADDRINUSE (a CI run lost a disaggregated cluster's worker so, ten tests
erred). Between the draw and the child's bind another process may still take the port: the
callers start servers that fail loudly then, never ones that share it.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST_PORT = 10_000  # below it: well-known and registered services' ports
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at `host` now, below the ephemeral range."""
    return free_port_block(1, host)


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A base port whose `count` consecutive ports nobody listens on at `host` now (a
    launcher's `--worker-base-port`), below the ephemeral range."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(LOWEST_PORT, low - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports at {host} below {low}")


def _ephemeral_low() -> int:
    """The ephemeral range's first port (Linux's default where /proc does not say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768
