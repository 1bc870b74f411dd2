"""The simulator's KV connector: the core scheduler's connector interface over simulated links.

A prefill leg (`do_remote_decode`) keeps its blocks when it finishes, until the decode worker
has read them. A decode leg (`do_remote_prefill`) asks for all but the last prompt token from
the prefill worker; once the scheduler has allocated blocks for them, the connector asks the
simulator to start the transfer, and reports it finished when the simulated bytes arrive.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.core.kv_connector import KVConnectorScheduler, KVTransferEvents
from pdserve.core.request import Request

# Called with (request, num_external_tokens) when blocks are ready to receive into.
StartTransfer = Callable[[Request, int], None]


def prefill_leg_params() -> dict:
    return {"do_remote_decode": True}


def decode_leg_params(num_prompt_tokens: int, source: object) -> dict:
    """Params of a decode leg whose prompt KV (all but the last token) lives at `source`."""
    return {"do_remote_prefill": True, "num_tokens": num_prompt_tokens - 1, "source": source}


class SimKVConnector(KVConnectorScheduler):
    """One worker's connector; the simulator reports transfer completions to it."""

    def __init__(self, start_transfer: StartTransfer) -> None:
        self._start_transfer = start_transfer
        self._events = KVTransferEvents()

    @property
    def recompute_on_failure(self) -> bool:
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0
        return max(params["num_tokens"] - num_computed_tokens, 0)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        # One transfer per request: after a later preemption it recomputes locally.
        request.kv_transfer_params["do_remote_prefill"] = False
        self._start_transfer(request, num_external_tokens)

    def request_finished(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return bool(params and params.get("do_remote_decode"))

    def get_finished(self) -> KVTransferEvents:
        events, self._events = self._events, KVTransferEvents()
        return events

    def mark_received(self, request_id: str) -> None:
        self._events.finished_recving.add(request_id)

    def mark_sent(self, request_id: str) -> None:
        self._events.finished_sending.add(request_id)
