"""`KVTransport`: the one interface every KV transport implements, for both roles.

Sender (prefill worker, `kv_producer`)::

    params = transport.expose(request_id, block_ids, num_tokens)   # lease + hand-off params
    ...                                                             # router carries params
    freed = transport.collect()    # engine thread, each step: request ids whose leases ended

Receiver (decode worker, `kv_consumer`)::

    stats = transport.receive(params, local_block_ids)   # fetch every layer, then release

or, for overlapped transfers, `fetch(params, units)` any number of times (each unit a layer
range of blocks, see `unit.py`), then `release(params)`.

A transport talks to each remote engine over one `KVClient` (control, and data for tcp),
opened on first use with a HELLO that checks protocol version, model, dtype and block layout
(after proving membership, where the deployment has a fleet secret). Every producer's KV server
serves FETCH, so reading a unit over that connection is the base class's way
(`_read_units`); `TcpTransport` keeps its cache in plain memory, `shm.ShmTransport` in a
shared segment that a receiver on the same host copies from directly, and `shm.AutoTransport`
chooses per pair.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from abc import ABC
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from pdserve.kv_transfer.blocks import StagedBlocks, StagingBuffer, byte_view, check_cache
from pdserve.kv_transfer.client import KVClient, release_lease, release_over
from pdserve.kv_transfer.config import KVRole, KVTransferConfig
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import (
    FrameError,
    KVIncompatibleError,
    KVLayout,
    KVLeaseError,
    KVProtocolError,
    KVStreamBroken,
    KVTransferError,
    KVTransferParams,
    KVTransferUnit,
    check_compatible,
    check_int,
    get_int,
    get_str,
    plan_units,
)
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.wire import MessageType

logger = logging.getLogger(__name__)

# Prefill engines a decode worker stays connected to at once: an autoscaled fleet replaces its
# prefill workers over time, and each one gone would otherwise keep its socket (and under shm
# its mapped cache) for the life of the process.
MAX_REMOTES = 32


# How long one WATCH waits for a streamed lease to grow before answering: short, since it
# holds the connection to that prefill worker (other requests' reads wait behind it).
WATCH_WAIT_S = 0.05


@dataclass(frozen=True)
class TransferStats:
    """What one `fetch`/`receive` moved, for the per-request timing breakdown.
    `exposed_seconds`: the part of `seconds` after the sender's request finished (all of it
    when pulled after prefill); `first_token_id`: what a streamed lease's sender sampled."""

    num_bytes: int
    num_units: int
    seconds: float
    exposed_seconds: float | None = None
    first_token_id: int | None = None


@dataclass
class RemoteEngine:
    """A connected, compatibility-checked prefill engine."""

    engine_id: str
    layout: KVLayout
    num_blocks: int
    client: KVClient
    hello: dict[str, Any]
    staging: StagingBuffer
    lock: threading.Lock = field(default_factory=threading.Lock)
    attachment: Any = None  # transport-specific (shm: the mapped remote cache)


class KVTransport(ABC):
    """Moves KV blocks between a prefill worker's and a decode worker's `kv_cache`.

    `kv_cache` is the engine's cache tensor,
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``. A producer needs a
    `LeaseManager` and starts a background `KVServer`.
    """

    name: ClassVar[str]

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: KVTransferConfig,
        leases: LeaseManager | None = None,
    ) -> None:
        check_cache(kv_cache, layout)
        if config.transport != self.name:
            raise ValueError(f"config.transport is {config.transport!r}, not {self.name!r}")
        if config.is_producer and leases is None:
            raise ValueError("a kv_producer transport needs a LeaseManager")
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self.leases = leases
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self._lock = threading.Lock()
        # Least recently used first; at most MAX_REMOTES.
        self._remotes: OrderedDict[tuple[str, str, int], RemoteEngine] = OrderedDict()
        # --fleet-tls: how this worker's KV connections to others are wrapped.
        self._client_tls = config.tls.client_context() if config.tls is not None else None
        self._server = self._start_server() if config.is_producer else None
        # Set when this worker shuts down: streamed receives stop at their next round.
        self._is_stopping = threading.Event()

    def _start_server(self) -> KVServer:
        config = self.config
        return KVServer(
            self.kv_cache,
            self.layout,
            self.leases,
            engine_id=self.engine_id,
            host=config.kv_host,
            port=config.kv_port,
            idle_timeout=config.kv_idle_timeout,
            hello_extra=self._hello_extra(),
            secret=config.secret,
            tls=config.tls.server_context() if config.tls is not None else None,
        )

    def switch_role(self, kv_role: KVRole) -> None:
        """Take part in KV transfer as `kv_role` from now on, in place: the cache and the
        engine id stay, the KV server starts (a producer) or stops (no longer one). Only with
        no lease held: the engine calls it between requests."""
        config = replace(self.config, kv_role=kv_role)
        if config.is_producer == self.config.is_producer:
            self.config = config
            return
        if self._server is not None:
            if self.leases.num_held_blocks:
                raise KVTransferError("cannot stop serving KV while leases are held")
            self._server.close()
            self.leases.close()
            self._server, self.leases = None, None
        self.config = config
        if config.is_producer:
            self.leases = LeaseManager(config.kv_lease_timeout)
            self._server = self._start_server()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[2]

    @property
    def server(self) -> KVServer | None:
        return self._server

    @property
    def num_remotes(self) -> int:
        """Remote engines currently connected (and, for shm, mapped)."""
        with self._lock:
            return len(self._remotes)

    # ---- sender (prefill worker) ----

    def expose(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        first_token_id: int | None = None,
    ) -> KVTransferParams:
        """Lease the blocks holding `num_tokens` tokens of `request_id`'s KV and return the
        decode leg's params. From now until `collect()` frees them the engine must not reuse
        these blocks."""
        if self._server is None:
            raise KVTransferError("this transport is not a kv_producer")
        check_int(num_tokens, "num_tokens", min_value=1)
        if len(block_ids) != self.layout.num_blocks_for(num_tokens):
            raise KVProtocolError(
                f"{num_tokens} tokens need "
                f"{self.layout.num_blocks_for(num_tokens)} blocks of "
                f"{self.layout.block_size}, got {len(block_ids)}"
            )
        for block_id in block_ids:
            check_int(block_id, "block_ids[]", max_value=self.num_blocks - 1)
        self.leases.grant(request_id, block_ids)
        return self._hand_off(request_id, block_ids, num_tokens, first_token_id)

    def open_stream(self, request_id: str, num_tokens: int) -> KVTransferParams:
        """Announce `request_id`'s KV before it is computed (a streamed lease, lease.py):
        `publish` then adds its blocks as steps complete them, `close_stream` the rest."""
        if self._server is None:
            raise KVTransferError("this transport is not a kv_producer")
        check_int(num_tokens, "num_tokens", min_value=1)
        self.leases.open_stream(request_id)
        return self._hand_off(request_id, (), num_tokens, None, is_streamed=True)

    def publish(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Blocks of a streamed lease whose KV is final, in token order."""
        self.leases.publish(request_id, block_ids)

    def close_stream(
        self, request_id: str, block_ids: Sequence[int], first_token_id: int | None
    ) -> None:
        """A streamed request finished: `block_ids` hold all its prompt (the published ones
        first); held until released or the lease timeout."""
        self.leases.close_stream(request_id, block_ids, first_token_id)

    def abandon_stream(self, request_id: str) -> None:
        """A streamed request ended without its KV (aborted, preempted)."""
        self.leases.abandon(request_id)

    def _hand_off(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        first_token_id: int | None,
        *,
        is_streamed: bool = False,
    ) -> KVTransferParams:
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_request_id=request_id,
            remote_host=self.config.advertise_host,
            remote_port=self._server.port,
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=num_tokens,
            layout_hash=self.layout.layout_hash(),
            first_token_id=first_token_id,
            is_streamed=is_streamed,
            **{"transport": self.name, **self._params_extra()},
        )

    def collect(self) -> list[str]:
        """End released and expired leases (engine thread); returns their request ids, whose
        blocks the engine may now reuse."""
        return self.leases.collect() if self.leases is not None else []

    # ---- receiver (decode worker) ----

    def receive(
        self, params: KVTransferParams, local_block_ids: Sequence[int], *, skip_blocks: int = 0
    ) -> TransferStats:
        """Fetch the request's KV, every layer, into `local_block_ids`, then release it; the
        data is good iff this returns (`KVLeaseError` if the lease ended first).

        The first `skip_blocks` remote blocks are not fetched (the decode worker already has
        them from its prefix cache); `local_block_ids[i]` receives remote block
        ``skip_blocks + i``. The remote lease is released even when the fetch fails.
        """
        remote_ids = params.remote_block_ids[skip_blocks : skip_blocks + len(local_block_ids)]
        if skip_blocks < 0 or len(remote_ids) != len(local_block_ids):
            raise KVProtocolError(
                f"cannot place remote blocks {skip_blocks}.. of "
                f"{len(params.remote_block_ids)} into "
                f"{len(local_block_ids)} local blocks"
            )
        start = time.perf_counter()
        try:
            fetched = self.fetch(
                params, plan_units(self.layout.num_layers, remote_ids, local_block_ids)
            )
        except KVTransferError:
            self.release_quietly(params)
            raise
        self._confirm(params)
        seconds = time.perf_counter() - start
        return TransferStats(fetched.num_bytes, fetched.num_units, seconds, seconds)

    def _confirm(self, params: KVTransferParams) -> None:
        if not self.release(params):
            raise KVLeaseError(
                f"the prefill worker's lease on request {params.remote_request_id!r} ended "
                "before the transfer was confirmed (kv_lease_timeout passed, or it was released "
                "already); the received KV is discarded"
            )

    def receive_stream(
        self, params: KVTransferParams, local_block_ids: Sequence[int], *, skip_blocks: int = 0
    ) -> TransferStats:
        """Receive a streamed lease's KV into `local_block_ids` (remote block
        ``skip_blocks + i`` into ``local_block_ids[i]``, as `receive`) while the sender still
        computes it: WATCH for the blocks published since the last round, copy them, repeat
        until the request finished, then release. Raises `KVStreamBroken` with the number of
        remote blocks that arrived and were confirmed (by a later WATCH) when it breaks off."""
        num_remote = self.layout.num_blocks_for(params.remote_num_tokens)
        if skip_blocks < 0 or skip_blocks + len(local_block_ids) != num_remote:
            raise KVProtocolError(
                f"cannot place remote blocks {skip_blocks}.. of {num_remote} into "
                f"{len(local_block_ids)} local blocks"
            )
        start = time.perf_counter()
        remote_ids: list[int] = []
        num_bytes = num_units = num_copied = num_confirmed = 0
        try:
            remote = self._remote(params)
            while True:
                if self._is_stopping.is_set():
                    raise KVTransferError("this worker is shutting down")
                is_complete, new_ids, first_token_id, complete_age_s = self._watch(
                    remote, params, len(remote_ids), num_remote
                )
                watched_at = time.perf_counter()
                num_confirmed = num_copied  # the lease was intact after those copies
                remote_ids += new_ids
                first = max(num_copied, skip_blocks)
                if len(remote_ids) > first:
                    units = plan_units(
                        self.layout.num_layers,
                        remote_ids[first:],
                        local_block_ids[first - skip_blocks : len(remote_ids) - skip_blocks],
                    )
                    with self._using(remote):
                        num_bytes += self._read_units(remote, params.remote_request_id, units)
                    num_units += len(units)
                num_copied = max(num_copied, len(remote_ids))
                if is_complete:
                    break
            self._confirm(replace(params, remote_block_ids=tuple(remote_ids)))
        except KVTransferError as exc:
            self.release_quietly(params)
            raise KVStreamBroken(str(exc), num_confirmed) from exc
        now = time.perf_counter()
        # Exposed: since the sender's request finished (bounded by this transfer's own time,
        # for a stream that started after its prefill ended).
        exposed = min(now - watched_at + complete_age_s, now - start)
        return TransferStats(num_bytes, num_units, now - start, exposed, first_token_id)

    def _watch(
        self, remote: RemoteEngine, params: KVTransferParams, num_known: int, num_remote: int
    ) -> tuple[bool, list[int], int | None, float]:
        """One WATCH round: (is_complete, new block ids, first token, seconds since the
        sender's request finished)."""
        with self._using(remote):
            reply = remote.client.call(
                MessageType.WATCH,
                {
                    "request_id": params.remote_request_id,
                    "num_known": num_known,
                    "wait_s": WATCH_WAIT_S,
                },
            )
        where = f"KV server {remote.client.address} WATCH reply"
        new_ids = reply.get("block_ids")
        if not isinstance(new_ids, list) or num_known + len(new_ids) > num_remote:
            raise KVProtocolError(f"{where}.block_ids must list at most {num_remote} blocks")
        for block_id in new_ids:
            check_int(block_id, f"{where}.block_ids[]", max_value=remote.num_blocks - 1)
        is_complete = reply.get("is_complete") is True
        first_token_id = get_int(reply, "first_token_id", where, required=False)
        if is_complete and (num_known + len(new_ids) != num_remote or first_token_id is None):
            raise KVProtocolError(f"{where}: a complete stream names all blocks and a token")
        age = reply.get("complete_age_s")
        age_s = float(age) if isinstance(age, int | float) and not isinstance(age, bool) else 0.0
        return is_complete, new_ids, first_token_id, max(age_s, 0.0)

    def fetch(self, params: KVTransferParams, units: Sequence[KVTransferUnit]) -> TransferStats:
        """Copy each unit's remote blocks into this engine's `kv_cache`; blocks until done.

        The copied data counts only once a later `release()` returns True (the shm transport
        copies without asking first); `receive()` does both. Raises `KVIncompatibleError`
        (version/model/dtype/layout), `KVLeaseError` (the sender no longer holds the blocks)
        or `KVTransferError` (unreachable, bad frames)."""
        if not params.do_remote_prefill:
            raise KVProtocolError(
                "kv_transfer_params.do_remote_prefill is not set: nothing to fetch"
            )
        if not self._accepts(params.transport):
            raise KVProtocolError(
                f"kv_transfer_params.transport is {params.transport!r}; "
                f"this worker's KV transport is {self.name!r}"
            )
        # Connect first: HELLO names a version/model/dtype/layout mismatch precisely, before
        # block counts computed from a foreign layout could fail confusingly.
        remote = self._remote(params)
        self._check_units(params, units)
        start = time.perf_counter()
        with self._using(remote):
            num_bytes = self._read_units(remote, params.remote_request_id, units)
        return TransferStats(num_bytes, len(units), time.perf_counter() - start)

    def release(self, params: KVTransferParams) -> bool:
        """Tell the sender it may free the request's blocks; also valid without any fetch
        (the decode side aborted the request). True iff the lease was still live, which
        confirms every block fetched under it."""
        with self._lock:
            remote = self._remotes.get(_remote_key(params))
        if remote is None:  # never fetched (aborted, or refused as incompatible)
            return release_lease(
                params, self.config.kv_transfer_timeout, self.config.secret, self._client_tls
            )
        with self._using(remote):
            return release_over(remote.client, params)

    def release_quietly(self, params: KVTransferParams) -> None:
        """`release`, logging a failure: the sender's lease timeout frees the blocks anyway
        (after a failed fetch, or for KV the decode side turned out not to need)."""
        try:
            self.release(params)
        except KVTransferError as exc:
            logger.info("could not release KV lease %r: %s", params.remote_request_id, exc)

    def stop_receiving(self) -> None:
        """End streamed receives at their next round (shutdown: they may wait on a sender
        that makes no progress)."""
        self._is_stopping.set()

    def close(self) -> None:
        """Stop serving, free every lease, drop remote connections."""
        self._is_stopping.set()
        if self._server is not None:
            self._server.close()
            self.leases.close()
        with self._lock:
            remotes = list(self._remotes.values())
            self._remotes.clear()
        for remote in remotes:
            remote.client.close()

    # ---- subclass hooks ----

    def _hello_extra(self) -> dict[str, Any]:
        """Extra HELLO reply fields a receiver of this transport needs."""
        return {}

    def _params_extra(self) -> dict[str, Any]:
        """Extra `KVTransferParams` fields this transport sets on `expose` (may override
        ``transport``: what it offers a receiver)."""
        return {}

    def _accepts(self, transport: str) -> bool:
        """Whether this receiver reads KV a sender offers as `transport`."""
        return transport == self.name

    def _attach(self, remote: RemoteEngine, params: KVTransferParams) -> Any:
        """Transport-specific setup on first contact; the result is `remote.attachment`."""
        return None

    def _read_units(
        self, remote: RemoteEngine, request_id: str, units: Sequence[KVTransferUnit]
    ) -> int:
        """Bring every unit's bytes into `self.kv_cache`; return the bytes moved. Called with
        `remote.lock` held. Here: over the sender's KV server, as `TcpTransport` describes."""
        return sum(self._read_unit(remote, request_id, unit) for unit in units)

    def _read_unit(self, remote: RemoteEngine, request_id: str, unit: KVTransferUnit) -> int:
        num_bytes = self.layout.nbytes(unit.num_blocks, unit.num_layers)
        meta = remote.client.call(
            MessageType.FETCH,
            {
                "request_id": request_id,
                "layer_start": unit.layer_start,
                "layer_end": unit.layer_end,
                "block_ids": list(unit.remote_block_ids),
            },
            expect=MessageType.DATA,
            payload_len=num_bytes,
        )
        layer = remote.staging.layer(unit.num_blocks)
        expected = {"dtype": self.layout.dtype, "shape": [unit.num_layers, *layer.shape[1:]]}
        if meta != expected:
            remote.client.close()  # the payload is still on the wire
            raise FrameError(
                f"KV server {remote.client.address} sent DATA {meta}, expected {expected}"
            )
        blocks = StagedBlocks(unit.local_block_ids)
        for index in range(unit.layer_start, unit.layer_end):
            remote.client.recv_into(byte_view(layer))
            blocks.scatter(self.kv_cache[index : index + 1], layer)
        return num_bytes

    # ---- internals ----

    def _check_units(self, params: KVTransferParams, units: Sequence[KVTransferUnit]) -> None:
        needed = self.layout.num_blocks_for(params.remote_num_tokens)
        if len(params.remote_block_ids) != needed:
            raise KVProtocolError(
                f"kv_transfer_params: {params.remote_num_tokens} tokens need "
                f"{needed} blocks, remote_block_ids has "
                f"{len(params.remote_block_ids)}"
            )
        leased = set(params.remote_block_ids)
        for unit in units:
            if unit.layer_end > self.layout.num_layers:
                raise KVProtocolError(
                    f"unit layers [{unit.layer_start}, {unit.layer_end}) "
                    f"exceed {self.layout.num_layers} layers"
                )
            if not leased.issuperset(unit.remote_block_ids):
                raise KVProtocolError(
                    "unit.remote_block_ids are not all in kv_transfer_params.remote_block_ids"
                )
            if max(unit.local_block_ids) >= self.num_blocks:
                raise KVProtocolError(
                    f"unit.local_block_ids exceed the local cache's {self.num_blocks} blocks"
                )

    def _remote(self, params: KVTransferParams) -> RemoteEngine:
        key = _remote_key(params)
        with self._lock:
            remote = self._remotes.get(key)
            if remote is None:
                remote = self._connect(params)
                self._remotes[key] = remote
                self._evict_beyond_limit()
            self._remotes.move_to_end(key)
            return remote

    def _evict_beyond_limit(self) -> None:
        """Drop the least recently used remotes beyond `MAX_REMOTES` that nobody is using
        (with `_lock` held); a later request to one reconnects."""
        for key in list(self._remotes)[: max(0, len(self._remotes) - MAX_REMOTES)]:
            remote = self._remotes[key]
            if remote.lock.acquire(blocking=False):
                try:
                    del self._remotes[key]
                    remote.client.close()
                finally:
                    remote.lock.release()

    def _connect(self, params: KVTransferParams) -> RemoteEngine:
        client = KVClient(
            params.remote_host,
            params.remote_port,
            self.config.kv_transfer_timeout,
            self.config.secret,
            self._client_tls,
        )
        try:
            hello = client.hello()
            remote = self._check_hello(client, hello, params)
            remote.attachment = self._attach(remote, params)
        except BaseException:
            client.close()
            raise
        return remote

    def _check_hello(
        self, client: KVClient, hello: dict[str, Any], params: KVTransferParams
    ) -> RemoteEngine:
        where = f"KV server {client.address} HELLO"
        version = get_int(hello, "protocol_version", where)
        engine_id = get_str(hello, "engine_id", where)
        remote_layout = KVLayout.from_dict(hello.get("layout"), f"{where}.layout")
        num_blocks = get_int(hello, "num_blocks", where, min_value=1)
        check_compatible(self.layout, remote_layout, version)
        if engine_id != params.remote_engine_id:
            raise KVTransferError(
                f"stale kv_transfer_params: {client.address} is engine "
                f"{engine_id}, not {params.remote_engine_id}"
            )
        if params.layout_hash != remote_layout.layout_hash():
            raise KVIncompatibleError(
                f"kv_transfer_params.layout_hash {params.layout_hash} does not match the KV "
                f"layout of {client.address} ({remote_layout.layout_hash()})",
                ["layout hash differs"],
            )
        return RemoteEngine(
            engine_id, remote_layout, num_blocks, client, hello, StagingBuffer(remote_layout)
        )

    @contextlib.contextmanager
    def _using(self, remote: RemoteEngine) -> Iterator[None]:
        """Talk to `remote` exclusively; on any failure but a lease refusal, forget it (its
        connection and shm mapping go; a live engine is reconnected on next use)."""
        with remote.lock:
            try:
                yield
            except KVLeaseError:
                raise
            except KVTransferError:
                self._forget(remote)
                raise

    def _forget(self, remote: RemoteEngine) -> None:
        remote.client.close()
        with self._lock:
            for key, value in list(self._remotes.items()):
                if value is remote:
                    del self._remotes[key]


def _remote_key(params: KVTransferParams) -> tuple[str, str, int]:
    return (params.remote_engine_id, params.remote_host, params.remote_port)


class TcpTransport(KVTransport):
    """KV transfer across hosts as framed raw tensor bytes (see wire.py); any `kv_cache`
    works.

    For each unit the receiver sends FETCH and the producer's KV server answers one DATA
    frame: the unit's blocks layer by layer, each layer
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. The receiver takes one layer at a
    time into a small reusable staging buffer and scatters it into its cache, so memory stays
    bounded and the scatter reads from CPU cache.
    """

    name: ClassVar[str] = "tcp"
