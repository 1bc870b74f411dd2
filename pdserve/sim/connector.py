"""The simulator's KV connector: the core scheduler's connector interface over simulated links.

A prefill leg (`add_prefill_leg`) keeps its blocks when it finishes, until the decode worker
has read them. A decode leg (`add_decode_leg`) asks for all but the last prompt token from
the prefill worker; once the scheduler has allocated blocks for them, the connector asks the
simulator to start the transfer, and reports it finished when the simulated bytes arrive.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.core.kv_connector import KVConnectorScheduler, KVTransferEvents
from pdserve.core.request import Request

# Called with (request, num_external_tokens, source) when blocks are ready to receive into.
StartTransfer = Callable[[Request, int, object], None]


class SimKVConnector(KVConnectorScheduler):
    """One worker's connector; the simulator reports transfer completions to it."""

    def __init__(self, start_transfer: StartTransfer) -> None:
        self._start_transfer = start_transfer
        self._sending: set[str] = set()
        # Decode legs not admitted yet: (tokens to receive, the worker holding them). One
        # transfer per request: after a later preemption it recomputes locally.
        self._remote: dict[str, tuple[int, object]] = {}
        self._events = KVTransferEvents()

    def add_prefill_leg(self, request_id: str) -> None:
        self._sending.add(request_id)

    def add_decode_leg(self, request_id: str, num_prompt_tokens: int, source: object) -> None:
        """The decode leg's prompt KV (all but the last token) lives at `source`."""
        self._remote[request_id] = (num_prompt_tokens - 1, source)

    @property
    def recompute_on_failure(self) -> bool:
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        num_tokens, _ = self._remote.get(request.request_id, (0, None))
        return max(num_tokens - num_computed_tokens, 0)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is not None and num_external_tokens > 0:
            self._start_transfer(request, num_external_tokens, remote[1])

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        self._remote.pop(request.request_id, None)
        is_prefill_leg = request.request_id in self._sending
        self._sending.discard(request.request_id)
        return is_prefill_leg, None

    def get_finished(self) -> KVTransferEvents:
        events, self._events = self._events, KVTransferEvents()
        return events

    def mark_received(self, request_id: str) -> None:
        self._events.finished_recving.add(request_id)

    def mark_sent(self, request_id: str) -> None:
        self._events.finished_sending.add(request_id)
