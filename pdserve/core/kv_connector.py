"""The scheduler side of a KV connector (after vLLM's split into scheduler and worker halves).

A connector lets KV computed elsewhere enter this scheduler's cache (a decode worker receiving
a prefill worker's blocks) and lets finished requests keep their blocks while another worker
reads them (a prefill worker sending). The worker side, which moves the bytes, lives in
`pdserve.kv_transfer`; this interface is pure Python so the simulator can implement it too.
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
        from elsewhere; 0 to compute them here."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """Blocks for the external tokens are in `request.block_table`: start receiving them
        into positions `[num_computed_tokens, num_computed_tokens + num_external_tokens)`."""

    @abstractmethod
    def request_finished(self, request: Request) -> bool:
        """A request ends (finished, aborted). True keeps its blocks allocated until its id
        appears in `finished_sending` or `finished_recving`/`failed_recving`."""

    @abstractmethod
    def get_finished(self) -> KVTransferEvents:
        """Poll transfers that completed or failed since the last call."""
