"""KV a prefill worker leased for a decode leg that never took it: freed now, not at the
lease's timeout (the decode worker refused the leg, none could be reached, or the client left
before it was sent). Without this the blocks stay held for --kv-lease-timeout seconds, which
under overload is exactly when the prefill worker needs them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.kv_transfer.client import release_lease
from pdserve.kv_transfer.protocol import KVTransferError, KVTransferParams

logger = logging.getLogger("pdserve.router")


class UnclaimedKV:
    """Sends RELEASE for unclaimed leases in the background (a refused request's answer
    does not wait on it)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()

    def release(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Free the lease these params (a prefill worker's answer) name; None: no lease."""
        if kv_transfer_params is None:
            return
        task = asyncio.get_running_loop().create_task(self._release(kv_transfer_params))
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _release(self, data: dict[str, Any]) -> None:
        try:
            params = KVTransferParams.from_dict(data)
            released = await asyncio.to_thread(release_lease, params, self.timeout_s)
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
