"""The HTTP-level hand-off (docs/architecture.md): the two legs' request bodies, and the KV a
prefill worker leased for a decode leg that never took it.

Unclaimed KV (the decode worker refused the leg, none could be reached, or the client left
before it was sent) is freed now, not at the lease's timeout: without this the blocks stay held
for --kv-lease-timeout seconds, which under overload is exactly when the prefill worker needs
them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.fleet import FleetTLS
from pdserve.kv_transfer.client import release_lease
from pdserve.kv_transfer.protocol import KVTransferError, KVTransferParams

logger = logging.getLogger("pdserve.router")

# Fields only the router may set on a leg; a client's own copies are dropped.
ROUTER_OWNED_FIELDS = ("kv_transfer_params", "router_timing")
# RELEASEs in flight at once; past it an unclaimed lease is left to its --kv-lease-timeout
# (a storm of refused requests against a KV port that does not answer must not pile up tasks).
MAX_PENDING_RELEASES = 256
# Dropped from the prefill leg: it generates exactly one token and answers in one body.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens")


def prefill_leg_body(body: dict[str, Any], *, is_streamed: bool = False) -> dict[str, Any]:
    """The client's request as a prefill leg: one token, KV kept for a decoder. Pulled: one
    body at the end. Streamed: an SSE stream whose first event announces the hand-off."""
    leg = {
        k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL and k not in ROUTER_OWNED_FIELDS
    }
    params = {"do_remote_decode": True, **({"is_streamed": True} if is_streamed else {})}
    leg.update(max_tokens=1, stream=is_streamed, kv_transfer_params=params)
    return leg


def decode_leg_body(
    body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    router_timing: dict[str, float],
    *,
    force_usage: bool,
) -> dict[str, Any]:
    """The client's request plus the prefill worker's `kv_transfer_params` (None: the decode
    worker prefills locally) and the router's timing. `force_usage` asks a stream for its
    final usage chunk, where the worker reports its timing."""
    leg = {k: v for k, v in body.items() if k not in ROUTER_OWNED_FIELDS}
    if kv_transfer_params is not None:
        leg["kv_transfer_params"] = kv_transfer_params
    leg["router_timing"] = router_timing
    if force_usage and leg.get("stream"):
        options = leg.get("stream_options")
        leg["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    return leg


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether the client itself asked a stream for the final usage chunk."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class UnclaimedKV:
    """Sends RELEASE for unclaimed leases in the background (a refused request's answer
    does not wait on it)."""

    def __init__(
        self, timeout_s: float, secret: str | None = None, tls: FleetTLS | None = None
    ) -> None:
        """`secret` and `tls`: the fleet's, which the prefill workers' KV servers ask for."""
        self.timeout_s = timeout_s
        self._secret = secret
        self._tls = tls.client_context() if tls is not None else None
        self._tasks: set[asyncio.Task] = set()

    def release(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Free the lease these params (a prefill worker's answer) name; None: no lease."""
        if kv_transfer_params is None:
            return
        if len(self._tasks) >= MAX_PENDING_RELEASES:
            logger.warning(
                "%d KV releases pending: lease %s is left to its timeout",
                len(self._tasks),
                kv_transfer_params.get("remote_request_id"),
            )
            return
        task = asyncio.get_running_loop().create_task(self._release(kv_transfer_params))
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _release(self, data: dict[str, Any]) -> None:
        try:
            params = KVTransferParams.from_dict(data)
            released = await asyncio.to_thread(
                release_lease, params, self.timeout_s, self._secret, self._tls
            )
        except (KVTransferError, OSError) as exc:
            logger.warning(
                "could not release unclaimed KV lease %s: %s", data.get("remote_request_id"), exc
            )
            return
        logger.info(
            "released unclaimed KV lease %s on %s:%s (%s)",
            params.remote_request_id,
            params.remote_host,
            params.remote_port,
            "freed" if released else "already gone",
        )
