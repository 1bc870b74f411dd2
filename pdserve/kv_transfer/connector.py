"""`KVConnector`: the scheduler's KV connector (core.kv_connector) backed by a `KVTransport`.

One per worker. On a prefill worker (`kv_producer`) a request that arrived with
``kv_transfer_params: {"do_remote_decode": true}`` and finished by length (the router's
``max_tokens=1`` leg) keeps its blocks under a lease; its `kv_transfer_params` become the
hand-off (`KVTransferParams.to_dict()`), which the engine returns in the final output. On a
decode worker (`kv_consumer`) a request with ``do_remote_prefill`` waits in
`WAITING_FOR_REMOTE_KV` while a background thread fetches the blocks it does not already
have in its prefix cache.

Threading: every method runs on the engine thread; transfers run on the receiver's pool and
the lease server's threads, and reach the scheduler only through `get_finished()`.
"""

from __future__ import annotations

import logging

from pdserve.core.kv_connector import KVConnectorScheduler, KVTransferEvents
from pdserve.core.request import FinishReason, Request
from pdserve.kv_transfer.background import BackgroundReceiver, FinishedTransfer
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.factory import create_kv_transport
from pdserve.kv_transfer.protocol import KVLayout, KVTransferParams
from pdserve.kv_transfer.transport import KVTransport

logger = logging.getLogger(__name__)


class KVConnector(KVConnectorScheduler):
    """Scheduler-side decisions over one worker's transport (see module docstring)."""

    def __init__(
        self,
        config: KVTransferConfig,
        layout: KVLayout,
        num_blocks: int,
        *,
        recompute_on_failure: bool = True,
    ) -> None:
        self._freed: list[str] = []
        self.transport: KVTransport = create_kv_transport(
            config, layout, num_blocks, free_blocks=lambda rid, ids: self._freed.append(rid)
        )
        self._receiver = BackgroundReceiver(self.transport) if config.is_consumer else None
        self._recompute_on_failure = recompute_on_failure
        self._receiving: set[str] = set()
        # Finished (aborted) while their fetch ran: its result has no reader.
        self._abandoned: set[str] = set()
        # Requests whose remote KV was tried or declined: if they come back (recompute after
        # a failure, preemption) they are computed here.
        self._settled: set[str] = set()
        self._results: dict[str, FinishedTransfer] = {}

    @property
    def recompute_on_failure(self) -> bool:
        return self._recompute_on_failure

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = self._remote_params(request)
        if params is None:
            return 0
        num_external = params.remote_num_tokens - num_computed_tokens
        if num_external <= 0:
            # The local prefix cache already holds all of it: free the sender's copy now.
            self._settled.add(request.request_id)
            self._receiver.submit_release(params)
            return 0
        return num_external

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        params = self._remote_params(request)
        layout = self.transport.layout
        # Tokens before the external ones are local prefix-cache hits: whole blocks.
        skip_blocks = (params.remote_num_tokens - num_external_tokens) // layout.block_size
        local_block_ids = request.block_table[
            skip_blocks : layout.num_blocks_for(params.remote_num_tokens)
        ]
        self._settled.add(request.request_id)
        self._receiving.add(request.request_id)
        self._receiver.submit(request.request_id, params, local_block_ids, skip_blocks)

    def request_finished(self, request: Request) -> bool:
        request_id = request.request_id
        self._settled.discard(request_id)
        if request_id in self._receiving:
            self._abandoned.add(request_id)
            return True  # the fetch still writes into its blocks
        if not self._should_send(request):
            return False
        num_tokens = request.num_prompt_tokens
        block_ids = request.block_table[: self.transport.layout.num_blocks_for(num_tokens)]
        first_token = request.output_token_ids[0] if request.output_token_ids else None
        params = self.transport.expose(request_id, block_ids, num_tokens, first_token)
        request.kv_transfer_params = params.to_dict()
        return True

    def get_finished(self) -> KVTransferEvents:
        events = KVTransferEvents()
        for finished in self._receiver.poll() if self._receiver is not None else []:
            self._receiving.discard(finished.request_id)
            if finished.request_id in self._abandoned:
                self._abandoned.discard(finished.request_id)
            else:
                self._results[finished.request_id] = finished
            if finished.is_ok:
                events.finished_recving.add(finished.request_id)
            else:
                logger.warning(
                    "KV transfer for request %r failed: %s", finished.request_id, finished.error
                )
                events.failed_recving.add(finished.request_id)
        self.transport.collect()
        events.finished_sending = set(self._freed)
        self._freed.clear()
        return events

    def pop_transfer_result(self, request_id: str) -> FinishedTransfer | None:
        """How the request's fetch went (bytes, seconds, or the error), once; for the
        timing breakdown and the error message of the fail policy."""
        return self._results.pop(request_id, None)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        self.transport.close()

    def _remote_params(self, request: Request) -> KVTransferParams | None:
        data = request.kv_transfer_params
        if (
            self._receiver is None
            or not data
            or not data.get("do_remote_prefill")
            or request.request_id in self._settled
        ):
            return None
        try:
            return KVTransferParams.from_dict(data)
        except KVTransferError as exc:
            # The server validates params at the HTTP layer; anything else is computed here.
            logger.warning("request %r: ignoring kv_transfer_params: %s", request.request_id, exc)
            self._settled.add(request.request_id)
            return None

    def _should_send(self, request: Request) -> bool:
        data = request.kv_transfer_params
        # Only the router's prefill leg ended by its max_tokens (core checks length before
        # stop tokens, so an EOS first token is leased too: the decode leg decides); an
        # aborted leg has nobody to fetch it.
        return (
            self.transport.server is not None
            and bool(data)
            and data.get("do_remote_decode") is True
            and request.finish_reason is FinishReason.LENGTH
            and request.num_computed_tokens >= request.num_prompt_tokens
        )
