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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pdserve.core.request import Request, SchedulerOutput
from pdserve.core.sampling_params import InvalidParameterError


@dataclass
class KVTransferEvents:
    """What finished since the last poll, by request id."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    # Requests whose held blocks nobody reads any more (sent, released, lease expired).
    finished_sending: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class KVTransferOutcome:
    """How a decode leg's KV arrived from its prefill worker. `exposed_seconds`: the part of
    `seconds` after the prefill worker's last step ended (on the critical path; the rest was
    hidden behind its compute); `num_kept_tokens`: prompt tokens that arrived before a
    stream broke off (the rest is computed here)."""

    num_bytes: int
    seconds: float
    error: str | None = None
    exposed_seconds: float | None = None
    num_kept_tokens: int | None = None


@dataclass(frozen=True)
class KVStoreOutcome:
    """What the shared KV store gave a request's prompt: tokens read, and how long it took."""

    num_hit_tokens: int
    seconds: float


@dataclass(frozen=True)
class KVOutcome:
    """What the connectors did for one request, taken once it settled (`take_result`)."""

    transfer: KVTransferOutcome | None = None
    store: KVStoreOutcome | None = None

    def merged(self, other: KVOutcome) -> KVOutcome:
        """These fields, with `other`'s wherever it has one."""
        set_fields = {
            f.name: getattr(other, f.name)
            for f in fields(other)
            if getattr(other, f.name) is not None
        }
        return replace(self, **set_fields)


@dataclass(frozen=True)
class KVAdmission:
    """What a leg's ``kv_transfer_params`` mean for the request at admission: the output
    tokens it starts with (a decode leg: the prefill worker's first token, when known), and
    a hand-off to announce before the request computes anything (a streamed prefill leg:
    where its KV will appear, chunk by chunk)."""

    output_token_ids: tuple[int, ...] = ()
    hand_off: dict[str, Any] | None = None


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


class KVConnectorBase(KVConnectorScheduler):
    """The engine's whole contract with a KV connector (after vLLM v1's): the scheduler's
    hooks above plus the worker side, each a no-op unless the connector needs it. The engine
    holds one (a `MultiConnector` over several) and knows no connector by type."""

    # Whether `add_request` takes a leg's ``kv_transfer_params`` (one connector per worker).
    accepts_kv_transfer_params = False

    def register_kv_caches(self, kv_cache: Any) -> None:
        """The cache the model runner allocated (its tensor, or the shared segment holding
        it): what this connector reads from and writes into. Called once, before any
        request."""

    def add_request(
        self, request_id: str, kv_transfer_params: Mapping[str, Any], num_prompt_tokens: int
    ) -> KVAdmission:
        """The one parse of a leg's params (only when `accepts_kv_transfer_params`); raises
        `InvalidParameterError` naming ``kv_transfer_params``."""
        raise NotImplementedError

    def save_after_step(self, output: SchedulerOutput, step_seconds: float) -> None:
        """After each step's forward pass (its KV is in the cache): save or publish what
        the step computed."""

    def take_result(self, request_id: str) -> KVOutcome:
        """What this connector did for the request, once (empty when nothing)."""
        return KVOutcome()

    def metrics_collectors(self) -> list[Any]:
        """Prometheus collectors for the server's registry."""
        return []

    @property
    def kv_role(self) -> Any:
        """The part this connector takes in disaggregated serving (None: none)."""
        return None

    def switch_role(self, kv_role: Any) -> None:
        """Take the other part from now on (only between requests)."""
        raise ValueError("this connector takes no part in disaggregated serving")

    def close(self) -> None:
        """Stop background threads, release shared resources."""


class MultiConnector(KVConnectorBase):
    """Several connectors as one (a disaggregated worker that also reads a shared KV store),
    or none (an engine without KV connectors): the first in order that offers a request's
    external tokens serves them, the others hear of the admission with 0 tokens.
    `recompute_on_failure` is the first connector's (failures come only from connectors that
    can fail)."""

    def __init__(self, *connectors: KVConnectorBase) -> None:
        self.connectors = connectors

    @property
    def recompute_on_failure(self) -> bool:
        return self.connectors[0].recompute_on_failure if self.connectors else True

    def register_kv_caches(self, kv_cache: Any) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_cache)

    def add_request(
        self,
        request_id: str,
        kv_transfer_params: Mapping[str, Any] | None,
        num_prompt_tokens: int,
    ) -> KVAdmission:
        """None or empty params: an ordinary request."""
        if not kv_transfer_params:
            return KVAdmission()
        for connector in self.connectors:
            if connector.accepts_kv_transfer_params:
                return connector.add_request(request_id, kv_transfer_params, num_prompt_tokens)
        raise InvalidParameterError(
            "kv_transfer_params",
            "this worker takes no part in KV transfer (start it with "
            "--role prefill or --role decode)",
        )

    def save_after_step(self, output: SchedulerOutput, step_seconds: float) -> None:
        for connector in self.connectors:
            connector.save_after_step(output, step_seconds)

    def take_result(self, request_id: str) -> KVOutcome:
        outcome = KVOutcome()
        for connector in self.connectors:
            outcome = outcome.merged(connector.take_result(request_id))
        return outcome

    def metrics_collectors(self) -> list[Any]:
        return [c for connector in self.connectors for c in connector.metrics_collectors()]

    @property
    def kv_role(self) -> Any:
        return next((c.kv_role for c in self.connectors if c.kv_role is not None), None)

    def switch_role(self, kv_role: Any) -> None:
        takers = [c for c in self.connectors if c.kv_role is not None]
        if not takers:
            raise ValueError("this worker takes no part in KV transfer (started without --role)")
        for connector in takers:
            connector.switch_role(kv_role)

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()

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
