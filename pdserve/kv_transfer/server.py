"""`KVServer`: the prefill worker's background thread answering KV requests.

One listening socket, one thread per connection (a few decode workers keep one connection
each; the count is capped). Requests carry no payload. A malformed or hostile frame is
logged and counted, answered with an ERROR frame when the socket still works, and closes that
connection only; a semantic refusal (unknown or expired lease) keeps the connection open.

With a fleet secret, a connection serves nothing (not even the HELLO facts: engine id, layout,
shm segment) until its peer proved membership (wire.py's handshake); any other request first,
or a wrong proof, is refused as ``unauthorized`` and the connection closed. After the proof
every frame both ways is sealed with the connection's session keys; a frame failing its tag
closes the connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kv_transfer.blocks import StagedBlocks, StagingBuffer, byte_view, dtype_name
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import (
    KV_TRANSFER_PROTOCOL_VERSION,
    KVAuthError,
    KVLayout,
    KVLeaseError,
    KVProtocolError,
    get_float,
    get_int,
    get_int_list,
    get_str,
)
from pdserve.kv_transfer.wire import (
    REQUEST_TYPES,
    ConnectionClosed,
    MessageType,
    Session,
    VersionMismatch,
    is_proof,
    new_nonce,
    proof,
    read_frame,
    send_frame,
    send_payload,
)

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
# The longest a WATCH waits for news before answering what it has.
MAX_WATCH_WAIT_S = 1.0
# After rejecting a frame: how long and how much to drain before closing.
_DRAIN_SECONDS = 0.2
_DRAIN_BYTES = 1 << 20


@dataclass
class _Connection:
    """One peer's connection and how far its handshake got."""

    sock: socket.socket
    peer: Any
    staging: StagingBuffer
    is_member: bool = False
    # The nonces of an outstanding CHALLENGE (the peer's, which may be "", and ours).
    nonces: tuple[str, str] | None = None
    # Streamed leases this peer watches and has not released: released when it goes away
    # (a decode worker that died mid-stream frees them now, not at the lease timeout).
    watched: set[str] = field(default_factory=set)
    # Seals every frame after a right AUTH (None: before it, or an open server).
    session: Session | None = None

    def send(self, msg_type: MessageType, meta: dict[str, Any], payload_len: int = 0) -> None:
        send_frame(self.sock, msg_type, meta, payload_len, self.session)


class KVServer:
    """Serves HELLO / FETCH / RELEASE for the leases of one engine's `kv_cache`."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        leases: LeaseManager,
        *,
        engine_id: str,
        host: str,
        port: int,
        idle_timeout: float,
        hello_extra: dict[str, Any] | None = None,
        secret: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`secret`: the deployment's fleet secret; None serves any peer (one host, tests).
        `tls`: every connection is wrapped in it first (`--fleet-tls`:
        `pdserve.fleet.FleetTLS.server_context`, which admits only the deployment's
        certificates); the handshake and sealed frames then run inside."""
        self._kv_cache = kv_cache
        self._layout = layout
        self._leases = leases
        self._hello = {
            "protocol_version": KV_TRANSFER_PROTOCOL_VERSION,
            "engine_id": engine_id,
            "layout": layout.to_dict(),
            "num_blocks": kv_cache.shape[2],
            **(hello_extra or {}),
        }
        self._idle_timeout = idle_timeout
        self._secret = secret
        self._tls = tls
        self._listener = socket.create_server((host, port))
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._is_closed = False
        self._handlers: dict[MessageType, Callable[[_Connection, dict], None]] = {
            MessageType.HELLO: self._on_hello,
            MessageType.AUTH: self._on_auth,
            MessageType.FETCH: self._on_fetch,
            MessageType.RELEASE: self._on_release,
            MessageType.WATCH: self._on_watch,
        }
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-server", daemon=True)
        self._acceptor.start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def close(self) -> None:
        """Stop accepting, drop every connection and wait for the acceptor thread."""
        with self._lock:
            self._is_closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                refuse = self._is_closed or len(self._connections) >= MAX_CONNECTIONS
                if not refuse:
                    self._connections.add(conn)
            if refuse:
                logger.warning(
                    "KV server refusing connection from %s: %d connections open",
                    peer,
                    MAX_CONNECTIONS,
                )
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer), name=f"kv-conn-{peer}", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        conn.settimeout(self._idle_timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(conn, peer, StagingBuffer(self._layout))
        connection.is_member = self._secret is None
        try:
            if self._tls is not None and not self._wrap(connection):
                return
            while self._handle_one(connection):
                pass
        except Exception:
            # Last line of defence: a bug in a handler ends this connection, never the server.
            logger.exception("KV server connection from %s failed", peer)
        finally:
            with self._lock:
                self._connections.discard(connection.sock)
            connection.sock.close()
            for request_id in connection.watched:
                if self._leases.release(request_id):
                    logger.warning(
                        "KV stream %r: its receiver %s went away; lease released",
                        request_id,
                        peer,
                    )

    def _wrap(self, connection: _Connection) -> bool:
        """Put the connection in TLS (in `_connections` too); False: the peer was refused."""
        raw = connection.sock
        try:
            connection.sock = self._tls.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            logger.warning("KV server refused a TLS session from %s: %s", connection.peer, exc)
            return False
        with self._lock:
            self._connections.discard(raw)
            self._connections.add(connection.sock)
        return True

    def _handle_one(self, connection: _Connection) -> bool:
        """Serve one request; False ends the connection."""
        try:
            frame = read_frame(connection.sock, max_payload=0, session=connection.session)
            if frame.msg_type not in REQUEST_TYPES:
                raise KVProtocolError(f"{frame.msg_type.name} is not a request")
            if not connection.is_member and frame.msg_type not in (
                MessageType.HELLO,
                MessageType.AUTH,
            ):
                raise KVAuthError(f"{frame.msg_type.name} before proving membership (HELLO)")
            self._handlers[frame.msg_type](connection, frame.meta)
            return True
        except (ConnectionClosed, OSError):
            return False  # peer gone, idle timeout, or server closing
        except VersionMismatch as exc:
            return self._reject(connection, "incompatible", str(exc))
        except KVProtocolError as exc:
            return self._reject(connection, "bad_request", str(exc))
        except KVAuthError as exc:
            return self._reject(connection, "unauthorized", str(exc))
        except KVLeaseError as exc:
            # A refusal, not an attack: the connection stays usable.
            try:
                connection.send(MessageType.ERROR, {"code": "lease", "error": str(exc)})
            except OSError:
                return False
            return True

    def _reject(self, connection: _Connection, code: str, reason: str) -> bool:
        logger.warning("KV server rejected a frame from %s: %s", connection.peer, reason)
        with contextlib.suppress(OSError):
            connection.send(MessageType.ERROR, {"code": code, "error": reason})
            _drain(connection.sock)
        return False

    def _on_hello(self, connection: _Connection, meta: dict) -> None:
        if connection.is_member:
            connection.send(MessageType.REPLY, self._hello)
            return
        theirs = get_str(meta, "nonce", "HELLO", required=False, max_len=64) or ""
        ours = new_nonce()
        connection.nonces = (theirs, ours)
        challenge = {"nonce": ours}
        if theirs:  # a peer that holds the secret checks ours before it answers
            challenge["proof"] = proof(self._secret, "server", theirs, ours)
        connection.send(MessageType.CHALLENGE, challenge)

    def _on_auth(self, connection: _Connection, meta: dict) -> None:
        if connection.is_member:
            raise KVProtocolError("AUTH on a connection that is authenticated already")
        if connection.nonces is None:
            raise KVAuthError("AUTH before HELLO")
        theirs, ours = connection.nonces
        connection.nonces = None  # one answer per challenge
        if not is_proof(meta.get("proof"), self._secret, "client", ours, theirs):
            raise KVAuthError("wrong proof: not a member of this deployment")
        connection.is_member = True
        connection.session = Session(self._secret, theirs, ours, is_client=False)
        connection.send(MessageType.REPLY, self._hello)

    def _on_release(self, connection: _Connection, meta: dict) -> None:
        request_id = _request_id(meta, "RELEASE")
        # Request ids are only unique per engine: never release for a previous incarnation.
        engine_id = get_str(meta, "engine_id", "RELEASE")
        if engine_id != self._hello["engine_id"]:
            raise KVLeaseError(
                f"RELEASE names engine {engine_id}, this is engine {self._hello['engine_id']}"
            )
        block_ids = get_int_list(meta, "block_ids", "RELEASE", max_len=self._kv_cache.shape[2])
        connection.watched.discard(request_id)
        released = self._leases.release(request_id, block_ids)
        connection.send(MessageType.REPLY, {"released": released})

    def _on_watch(self, connection: _Connection, meta: dict) -> None:
        request_id = _request_id(meta, "WATCH")
        num_known = get_int(meta, "num_known", "WATCH", max_value=self._kv_cache.shape[2])
        wait_s = get_float(meta, "wait_s", "WATCH", max_value=MAX_WATCH_WAIT_S)
        connection.watched.add(request_id)
        state = self._leases.watch(request_id, num_known, wait_s)
        connection.send(
            MessageType.REPLY,
            {
                "block_ids": list(state.block_ids),
                "is_complete": state.is_complete,
                "first_token_id": state.first_token_id,
                "complete_age_s": state.complete_age_s,
            },
        )

    def _on_fetch(self, connection: _Connection, meta: dict) -> None:
        request_id = _request_id(meta, "FETCH")
        num_layers = self._layout.num_layers
        start = get_int(meta, "layer_start", "FETCH", max_value=num_layers - 1)
        end = get_int(meta, "layer_end", "FETCH", min_value=start + 1, max_value=num_layers)
        num_blocks = self._kv_cache.shape[2]
        block_ids = get_int_list(
            meta, "block_ids", "FETCH", max_len=num_blocks, max_value=num_blocks - 1
        )
        if not block_ids:
            raise KVProtocolError("FETCH.block_ids names no blocks")
        with self._leases.reading(request_id) as lease:
            outside = set(block_ids) - set(lease.block_ids)
            if outside:
                raise KVLeaseError(
                    f"FETCH.block_ids {sorted(outside)[:8]} are not leased to "
                    f"request {request_id!r}"
                )
            self._send_layers(connection, start, end, block_ids)

    def _send_layers(
        self, connection: _Connection, start: int, end: int, block_ids: tuple[int, ...]
    ) -> None:
        # Gather one layer at a time into a small staging buffer that stays in cache while the
        # kernel copies it into the socket: bounded memory, no whole-request temporary.
        layer = connection.staging.layer(len(block_ids))
        payload_len = (end - start) * layer.numel() * layer.element_size()
        connection.send(
            MessageType.DATA,
            {"dtype": dtype_name(layer.dtype), "shape": [end - start, *layer.shape[1:]]},
            payload_len,
        )
        blocks = StagedBlocks(block_ids)
        for index in range(start, end):
            blocks.gather(self._kv_cache[index : index + 1], layer)
            send_payload(connection.sock, byte_view(layer), connection.session)


def _request_id(meta: dict, where: str) -> str:
    return get_str(meta, "request_id", where, max_len=1024)


def _drain(conn: socket.socket) -> None:
    """Half-close and swallow what the peer already sent (bounded), so closing does not
    reset the connection and the peer can read our ERROR frame."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(_DRAIN_SECONDS)
    budget = _DRAIN_BYTES
    while budget > 0 and (chunk := conn.recv(min(budget, 65536))):
        budget -= len(chunk)
