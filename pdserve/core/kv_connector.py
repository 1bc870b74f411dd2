"""The scheduler side of a KV connector (after vLLM's split into scheduler and worker halves).

A connector lets KV computed elsewhere enter this scheduler's cache (a decode worker receiving
a prefill worker's blocks) and lets finished requests keep their blocks while another worker
reads them (a prefill worker sending). The worker side, which moves the bytes, lives in
`pdserve.kv_transfer`; this interface is pure Python so the simulator can implement it too.

What a request's KV hand-off says (where its KV comes from, or that it should be kept for
another worker) the connector learns from its owner when the request is added, keyed by
request id; the scheduler passes only `Request`s, and never reads or writes hand-off data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pdserve.core.request import Request


@dataclass
class KVTransferEvents:
    """What finished since the last poll, by request id."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    # Requests whose held blocks nobody reads any more (sent, released, lease expired).
    finished_sending: set[str] = field(default_factory=set)


class KVConnectorScheduler(ABC):
    """Scheduler-side decisions about KV that lives on another worker."""

    @property
    @abstractmethod
    def recompute_on_failure(self) -> bool:
        """After a failed receive: recompute the prompt locally (True) or fail the request."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """How many tokens past `num_computed_tokens` (computed or cached locally) will arrive
        from elsewhere; 0 to compute them here.

        A query without side effects: the scheduler asks again, step after step, while the
        request waits for free blocks, and the same state gets the same answer."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """The request was admitted and its blocks are in `request.block_table`. With
        `num_external_tokens` > 0: start receiving them into positions
        `[num_computed_tokens, num_computed_tokens + num_external_tokens)`. With 0 it is
        computed here (nothing remote, or its local prefix cache holds all of it): any
        remote copy may be given up. Called on every admission, also after a preemption."""

    @abstractmethod
    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        """A request ends (finished, aborted); the request is not modified. Returns
        `(delay_free_blocks, kv_transfer_params)`: True keeps its blocks allocated until its
        id appears in `finished_sending` or `finished_recving`/`failed_recving`; the params
        (JSON-ready, or None) are what its final output hands to the next leg."""

    @abstractmethod
    def get_finished(self) -> KVTransferEvents:
        """Poll transfers that completed or failed since the last call."""


class MultiConnector(KVConnectorScheduler):
    """Several connectors as one (a disaggregated worker that also reads a shared KV store):
    the first in order that offers a request's external tokens serves them, the others
    hear of the admission with 0 tokens. `recompute_on_failure` is the first connector's
    (failures come only from connectors that can fail)."""

    def __init__(self, *connectors: KVConnectorScheduler) -> None:
        if not connectors:
            raise ValueError("MultiConnector needs at least one connector")
        self.connectors = connectors

    @property
    def recompute_on_failure(self) -> bool:
        return self.connectors[0].recompute_on_failure

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        for connector in self.connectors:
            num_external = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_external:
                return num_external
        return 0

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        # The positions before the external tokens: `allocate_slots` has moved
        # `num_computed_tokens` past the local prefix-cache hits already.
        num_local = request.num_computed_tokens
        server = None
        if num_external_tokens:
            server = next(
                c
                for c in self.connectors
                if c.get_num_new_matched_tokens(request, num_local) == num_external_tokens
            )
        for connector in self.connectors:
            connector.update_state_after_alloc(
                request, num_external_tokens if connector is server else 0
            )

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        is_held, hand_off = False, None
        for connector in self.connectors:
            held, params = connector.request_finished(request)
            is_held = is_held or held
            hand_off = hand_off if params is None else params
        return is_held, hand_off

    def get_finished(self) -> KVTransferEvents:
        events = KVTransferEvents()
        for connector in self.connectors:
            part = connector.get_finished()
            events.finished_recving |= part.finished_recving
            events.failed_recving |= part.failed_recving
            events.finished_sending |= part.finished_sending
        return events
