"""`KVConnector`: the scheduler's KV connector (core.kv_connector) backed by a `KVTransport`.

One per worker. `add_request` is the one parse of a leg's ``kv_transfer_params`` on this
worker: the typed result is kept here by request id, for the scheduler's hooks to act on. On
a prefill worker (`kv_producer`) a request that arrived with ``{"do_remote_decode": true}``
and finished by length (the router's ``max_tokens=1`` leg) keeps its blocks under a lease, and
`request_finished` returns the hand-off (`KVTransferParams.to_dict()`) for its final output.
On a decode worker (`kv_consumer`) a request with ``do_remote_prefill`` waits in
`WAITING_FOR_REMOTE_KV` while a `BackgroundReceiver` fetches the blocks it does not already
have in its prefix cache; the engine keeps stepping other requests and polls for results.
Writes go only to the submitted blocks, which the engine does not touch until the transfer
is polled.

Threading: every method runs on the engine thread; transfers run on the receiver's pool and
the lease server's threads, and reach the scheduler only through `get_finished()`.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.core.kv_connector import (
    KVAdmission,
    KVConnectorBase,
    KVOutcome,
    KVTransferEvents,
    KVTransferOutcome,
)
from pdserve.core.request import FinishReason, Request, SchedulerOutput
from pdserve.core.sampling_params import InvalidParameterError
from pdserve.kv_transfer.blocks import TORCH_DTYPES
from pdserve.kv_transfer.config import KVRole, KVTransferConfig
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import KVLayout, KVTransferError, KVTransferParams
from pdserve.kv_transfer.registry import TRANSPORTS
from pdserve.kv_transfer.shm import SharedKVCache
from pdserve.kv_transfer.transport import KVTransport, TransferStats

logger = logging.getLogger(__name__)


def create_kv_transport(config: KVTransferConfig, layout: KVLayout, num_blocks: int) -> KVTransport:
    """A transport with a cache of its own (tools and tests; an engine's connector registers
    the cache its model runner allocated, `transport_over`)."""
    if config.needs_shared_cache:
        return transport_over(config, layout, SharedKVCache.create(layout, num_blocks))
    # zero_() rather than torch.zeros: writing every page now means no transfer ever pays
    # for first-touch page faults (torch.zeros may hand back lazily-zeroed pages).
    cache = torch.empty(layout.cache_shape(num_blocks), dtype=TORCH_DTYPES[layout.dtype]).zero_()
    return transport_over(config, layout, cache)


def transport_over(
    config: KVTransferConfig, layout: KVLayout, kv_caches: torch.Tensor | SharedKVCache
) -> KVTransport:
    """The transport that moves KV in and out of `kv_caches`: a shared segment for shm and
    auto (receivers on this host map it), any CPU tensor for tcp."""
    entry = TRANSPORTS[config.transport]
    transport_type = getattr(importlib.import_module(entry.module), entry.class_name)
    leases = LeaseManager(config.kv_lease_timeout) if config.is_producer else None
    if not entry.needs_shared_cache:
        cache = kv_caches.tensor if isinstance(kv_caches, SharedKVCache) else kv_caches
        return transport_type(cache, layout, config, leases)
    if not isinstance(kv_caches, SharedKVCache):
        raise ValueError(f"the {config.transport!r} KV transport needs a shared-memory cache")
    return transport_type(kv_caches, layout, config, leases)


@dataclass(frozen=True)
class FinishedTransfer:
    """Outcome of one submitted transfer: `stats` on success, else `error`."""

    request_id: str
    stats: TransferStats | None
    error: BaseException | None

    @property
    def is_ok(self) -> bool:
        return self.error is None


# Streamed receives running at once: each lasts as long as its prefill, so pulls (one at a
# time, `BackgroundReceiver`) never queue behind them.
MAX_STREAMS = 8


class BackgroundReceiver:
    """Small thread pools around `KVTransport.receive` and `receive_stream`."""

    def __init__(self, transport: KVTransport) -> None:
        self._transport = transport
        # One transfer at a time, in submission order: they share one link anyway.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-recv")
        self._stream_pool = ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix="kv-stream")
        self._lock = threading.Lock()
        self._finished: list[FinishedTransfer] = []

    def submit(
        self,
        request_id: str,
        params: KVTransferParams,
        local_block_ids: Sequence[int],
        skip_blocks: int = 0,
    ) -> None:
        """Start fetching `params`' blocks into `local_block_ids` (see `KVTransport.receive`)."""
        pool, receive = (
            (self._stream_pool, self._transport.receive_stream)
            if params.is_streamed
            else (self._pool, self._transport.receive)
        )
        future = pool.submit(receive, params, tuple(local_block_ids), skip_blocks=skip_blocks)
        future.add_done_callback(lambda f: self._done(request_id, f))

    def submit_release(self, params: KVTransferParams) -> None:
        """Release a lease without fetching (the data is not needed), off the engine thread.
        A failure is only logged: the sender's lease timeout frees the blocks anyway."""
        self._pool.submit(self._transport.release_quietly, params)

    def poll(self) -> list[FinishedTransfer]:
        """Transfers finished since the last poll."""
        with self._lock:
            finished, self._finished = self._finished, []
            return finished

    def close(self) -> None:
        """Wait for running transfers (bounded by the transfer timeout) and stop the pools."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._stream_pool.shutdown(wait=True, cancel_futures=True)

    def _done(self, request_id: str, future: Future) -> None:
        if future.cancelled():
            error: BaseException | None = RuntimeError("KV transfer cancelled at shutdown")
        else:
            error = future.exception()
        stats = future.result() if error is None else None
        with self._lock:
            self._finished.append(FinishedTransfer(request_id, stats, error))


class KVConnector(KVConnectorBase):
    """Scheduler-side decisions over one worker's transport (see module docstring)."""

    accepts_kv_transfer_params = True

    def __init__(
        self,
        config: KVTransferConfig,
        layout: KVLayout,
        *,
        recompute_on_failure: bool = True,
    ) -> None:
        self._config = config
        self._layout = layout
        # Set by `register_kv_caches`, before any request.
        self.transport: KVTransport | None = None
        self._receiver: BackgroundReceiver | None = None
        self._recompute_on_failure = recompute_on_failure
        # Prefill legs this worker leases when they finish.
        self._sending: set[str] = set()
        # Streamed prefill legs: how many of their blocks are published so far.
        self._streaming: dict[str, int] = {}
        # Streamed decode legs being received: the request, and its blocks found locally.
        self._streams: dict[str, tuple[Request, int]] = {}
        # Streamed decode legs that broke off: prompt tokens kept from the stream.
        self._kept: dict[str, int] = {}
        # Decode legs whose remote KV is neither fetched nor given up yet: entries leave at
        # their first admission, so a request that comes back (recompute after a failure,
        # preemption) is computed here.
        self._remote: dict[str, KVTransferParams] = {}
        self._receiving: set[str] = set()
        # Finished (aborted) while their fetch ran: its result has no reader.
        self._abandoned: set[str] = set()
        self._results: dict[str, FinishedTransfer] = {}

    @property
    def recompute_on_failure(self) -> bool:
        return self._recompute_on_failure

    def register_kv_caches(self, kv_cache: torch.Tensor | SharedKVCache) -> None:
        self.transport = transport_over(self._config, self._layout, kv_cache)
        if self._config.is_consumer:
            self._receiver = BackgroundReceiver(self.transport)

    def add_request(
        self, request_id: str, kv_transfer_params: Mapping[str, Any], num_prompt_tokens: int
    ) -> KVAdmission:
        """Parse and check a leg's params and remember what they ask of this worker; a
        decode leg starts with the prefill worker's first token. Raises
        `InvalidParameterError` naming ``kv_transfer_params``."""
        try:
            params = KVTransferParams.from_dict(kv_transfer_params)
        except KVTransferError as exc:
            raise _invalid(str(exc)) from exc
        if params.do_remote_decode:
            if self.transport.server is None:
                return KVAdmission()
            self._sending.add(request_id)
            if not params.is_streamed:
                return KVAdmission()
            self._streaming[request_id] = 0
            hand_off = self.transport.open_stream(request_id, num_prompt_tokens)
            return KVAdmission(hand_off=hand_off.to_dict())
        if not params.do_remote_prefill:
            return KVAdmission()
        self._check_hand_off(params, num_prompt_tokens)
        if self._receiver is not None:
            self._remote[request_id] = params
        # A streamed leg's first token comes with its last chunk (`get_finished`).
        return KVAdmission(() if params.is_streamed else (params.first_token_id,))

    def save_after_step(self, output: SchedulerOutput, step_seconds: float) -> None:
        """Publish the prompt blocks this step completed of each streamed prefill leg."""
        block_size = self.transport.layout.block_size
        for scheduled in output.scheduled:
            request = scheduled.request
            num_published = self._streaming.get(request.request_id)
            if num_published is None:
                continue
            num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // block_size
            if num_full > num_published:
                self.transport.publish(
                    request.request_id, request.block_table[num_published:num_full]
                )
                self._streaming[request.request_id] = num_full

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = self._remote.get(request.request_id)
        if params is None:
            return 0
        return max(params.remote_num_tokens - num_computed_tokens, 0)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        params = self._remote.pop(request.request_id, None)
        if params is None:
            return
        if num_external_tokens == 0:
            # The local prefix cache already holds all of it: free the sender's copy now.
            self._receiver.submit_release(params)
            return
        layout = self.transport.layout
        # Tokens before the external ones are local prefix-cache hits: whole blocks.
        skip_blocks = (params.remote_num_tokens - num_external_tokens) // layout.block_size
        local_block_ids = request.block_table[
            skip_blocks : layout.num_blocks_for(params.remote_num_tokens)
        ]
        self._receiving.add(request.request_id)
        if params.is_streamed:
            self._streams[request.request_id] = (request, skip_blocks)
        self._receiver.submit(request.request_id, params, local_block_ids, skip_blocks)

    def request_preempted(self, request: Request) -> None:
        if request.request_id in self._streaming:
            # Its published blocks are free now: end the stream before anything reuses them
            # (a WATCH answered after this cannot confirm a copy).
            self._end_stream(request.request_id)

    def _end_stream(self, request_id: str) -> None:
        """A streamed prefill leg that will not deliver its KV: its receiver hears now."""
        self._streaming.pop(request_id, None)
        self._sending.discard(request_id)
        self.transport.abandon_stream(request_id)

    def request_finished(self, request: Request) -> tuple[bool, dict | None]:
        request_id = request.request_id
        if request_id in self._streaming:
            return self._stream_finished(request), None
        is_prefill_leg = request_id in self._sending
        self._sending.discard(request_id)
        unfetched = self._remote.pop(request_id, None)
        if unfetched is not None:  # ended before its admission: nobody will fetch it
            self._receiver.submit_release(unfetched)
        if request_id in self._receiving:
            self._abandoned.add(request_id)
            return True, None  # the fetch still writes into its blocks
        if not (is_prefill_leg and _is_complete_prefill_leg(request)):
            return False, None
        num_tokens = request.num_prompt_tokens
        block_ids = request.block_table[: self.transport.layout.num_blocks_for(num_tokens)]
        first_token = request.output_token_ids[0] if request.output_token_ids else None
        params = self.transport.expose(request_id, block_ids, num_tokens, first_token)
        return True, params.to_dict()

    def _stream_finished(self, request: Request) -> bool:
        """Close a streamed prefill leg's lease with all its blocks (True: they stay held
        for the receiver), or end it when the leg did not compute its prompt (aborted)."""
        if not _is_complete_prefill_leg(request):
            self._end_stream(request.request_id)
            return False
        self._streaming.pop(request.request_id)
        self._sending.discard(request.request_id)
        num_blocks = self.transport.layout.num_blocks_for(request.num_prompt_tokens)
        first_token = request.output_token_ids[0] if request.output_token_ids else None
        self.transport.close_stream(
            request.request_id, request.block_table[:num_blocks], first_token
        )
        return True

    def get_finished(self) -> KVTransferEvents:
        events = KVTransferEvents(finished_sending=set(self.transport.collect()))
        for finished in self._receiver.poll() if self._receiver is not None else []:
            self._receiving.discard(finished.request_id)
            stream = self._streams.pop(finished.request_id, None)
            if finished.request_id in self._abandoned:
                self._abandoned.discard(finished.request_id)
            else:
                self._results[finished.request_id] = finished
                if stream is not None and self._settle_stream(finished, *stream):
                    events.finished_recving.add(finished.request_id)
                    continue
            if finished.is_ok:
                events.finished_recving.add(finished.request_id)
            else:
                logger.warning(
                    "KV transfer for request %r failed: %s", finished.request_id, finished.error
                )
                events.failed_recving.add(finished.request_id)
        return events

    def _settle_stream(
        self, finished: FinishedTransfer, request: Request, skip_blocks: int
    ) -> bool:
        """A streamed receive ended: True when the request goes on with what arrived (all of
        it, with the first token; or the chunks confirmed before it broke off, computing the
        rest here), False when nothing arrived (then it failed)."""
        if finished.is_ok:
            request.append_output_token(finished.stats.first_token_id)
            return True
        block_size = self.transport.layout.block_size
        num_confirmed = getattr(finished.error, "num_confirmed_blocks", 0)
        # At least one prompt token stays to compute here, to sample the first token from.
        num_kept = min(num_confirmed, (request.num_prompt_tokens - 1) // block_size)
        num_kept_tokens = (num_kept - skip_blocks) * block_size
        if num_kept_tokens <= 0:
            return False
        request.num_external_tokens = num_kept_tokens
        self._kept[request.request_id] = num_kept_tokens
        logger.warning(
            "KV stream for request %r broke off (%s): kept %d of %d prompt tokens, "
            "computing the rest here",
            request.request_id,
            finished.error,
            num_kept_tokens,
            request.num_prompt_tokens - skip_blocks * block_size,
        )
        return True

    def take_result(self, request_id: str) -> KVOutcome:
        """How the request's fetch went (bytes, seconds, or the error), once; for the
        timing breakdown and the error message of the fail policy."""
        result = self._results.pop(request_id, None)
        num_kept = self._kept.pop(request_id, None)
        if result is None:
            return KVOutcome()
        if result.stats is None:
            return KVOutcome(
                transfer=KVTransferOutcome(0, 0.0, str(result.error), num_kept_tokens=num_kept)
            )
        stats = result.stats
        return KVOutcome(
            transfer=KVTransferOutcome(stats.num_bytes, stats.seconds, None, stats.exposed_seconds)
        )

    @property
    def kv_role(self) -> KVRole:
        return self.transport.config.kv_role

    def switch_role(self, kv_role: KVRole) -> None:
        """Send or receive KV from now on as `kv_role`, on the same cache (a prefill worker
        turned decode worker, or back). Only between requests: nothing leased, nothing
        moving, no leg waiting for its KV."""
        if self._sending or self._remote or self._receiving or self._abandoned or self._streams:
            raise RuntimeError("cannot switch the KV role while transfers are under way")
        self.transport.switch_role(kv_role)
        is_consumer = self.transport.config.is_consumer
        if is_consumer and self._receiver is None:
            self._receiver = BackgroundReceiver(self.transport)
        elif not is_consumer and self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.stop_receiving()
        if self._receiver is not None:
            self._receiver.close()
        if self.transport is not None:
            self.transport.close()

    def _check_hand_off(self, params: KVTransferParams, num_prompt_tokens: int) -> None:
        layout = self.transport.layout
        if params.layout_hash != layout.layout_hash():
            raise _invalid(
                "layout_hash differs from this worker's KV layout "
                f"(model {layout.model_id}, {layout.dtype}, block_size {layout.block_size}, "
                f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
                f"{layout.head_dim}): the prefill worker runs another model, dtype or layout"
            )
        if params.remote_num_tokens != num_prompt_tokens or (
            params.first_token_id is None and not params.is_streamed
        ):
            raise _invalid(
                f"remote_num_tokens must equal the prompt's {num_prompt_tokens} "
                "tokens and first_token_id must be set"
            )


def _is_complete_prefill_leg(request: Request) -> bool:
    """Only the router's prefill leg ended by its max_tokens (core checks length before stop
    tokens, so an EOS first token is leased too: the decode leg decides); an aborted leg has
    nobody to fetch it."""
    return (
        request.finish_reason is FinishReason.LENGTH
        and request.num_computed_tokens >= request.num_prompt_tokens
    )


def _invalid(message: str) -> InvalidParameterError:
    return InvalidParameterError("kv_transfer_params", message)
