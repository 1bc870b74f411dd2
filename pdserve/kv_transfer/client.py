"""`KVClient`: the decode worker's connection to one prefill worker's `KVServer`.

Requests are strictly one at a time per connection (guarded by the caller). Any failure part-way
through a response leaves the stream in an unknown state, so the connection is closed and the
next request reconnects. A client with the fleet secret proves membership on every new
connection, and checks the server's proof, before its first request (wire.py's handshake);
every frame after it is sealed with that connection's session keys.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
from typing import Any

from pdserve.kv_transfer.protocol import (
    FrameError,
    KVAuthError,
    KVIncompatibleError,
    KVLeaseError,
    KVProtocolError,
    KVTransferError,
    KVTransferParams,
    check_protocol_version,
    get_str,
)
from pdserve.kv_transfer.wire import (
    ConnectionClosed,
    MessageType,
    Session,
    VersionMismatch,
    is_proof,
    new_nonce,
    proof,
    read_frame,
    recv_payload_into,
    send_frame,
)

_ERROR_CODES = {
    "lease": KVLeaseError,
    "incompatible": KVIncompatibleError,
    "bad_request": KVProtocolError,
    "unauthorized": KVAuthError,
}


class KVClient:
    """Framed request/response over one TCP connection, reconnecting when it went stale."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        secret: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`secret`: the deployment's fleet secret (None: talk to open servers only); `tls`:
        wrap each connection in it (`--fleet-tls`: `pdserve.fleet.FleetTLS.client_context`)
        before the handshake."""
        self.host = host
        self.port = port
        self._timeout = timeout
        self._secret = secret
        self._tls = tls
        self._sock: socket.socket | None = None
        # Seals this connection's frames once its handshake is done.
        self._session: Session | None = None
        # The server's HELLO reply on this connection, once the handshake got it.
        self._hello: dict[str, Any] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def call(
        self,
        msg_type: MessageType,
        meta: dict[str, Any],
        *,
        expect: MessageType = MessageType.REPLY,
        payload_len: int = 0,
    ) -> dict[str, Any]:
        """Send a request and read the response header and metadata.

        For `expect=DATA` the caller then reads exactly `payload_len` bytes with `recv_into`.
        A remote ERROR frame raises the matching `KVTransferError` subclass.
        """
        return self._exchange(self._connected(), msg_type, meta, expect, payload_len)

    def hello(self) -> dict[str, Any]:
        """The server's HELLO reply (protocol version, engine id, layout, ...)."""
        if self._secret is None:
            return self.call(MessageType.HELLO, {})
        self._connected()  # the handshake's last answer is the HELLO reply
        return self._hello

    def _exchange(
        self,
        sock: socket.socket,
        msg_type: MessageType,
        meta: dict[str, Any],
        expect: MessageType,
        payload_len: int = 0,
    ) -> dict[str, Any]:
        self._send(sock, msg_type, meta)
        return self._answer(sock, expect, payload_len)

    def _send(self, sock: socket.socket, msg_type: MessageType, meta: dict[str, Any]) -> None:
        try:
            send_frame(sock, msg_type, meta, session=self._session)
        except OSError as exc:
            self.close()
            raise _failure(self.address, exc) from None

    def _answer(
        self, sock: socket.socket, expect: MessageType, payload_len: int = 0
    ) -> dict[str, Any]:
        try:
            frame = read_frame(sock, max_payload=payload_len, session=self._session)
        except VersionMismatch as exc:
            self.close()
            check_protocol_version(exc.version, f"KV server {self.address}")
            raise
        except (FrameError, ConnectionClosed, OSError) as exc:
            self.close()
            raise _failure(self.address, exc) from None
        if frame.msg_type is MessageType.ERROR:
            self._raise_remote_error(frame.meta)
        if frame.msg_type is not expect and MessageType.CHALLENGE in (frame.msg_type, expect):
            self.close()
            raise KVAuthError(_membership_mismatch(self.address, frame.msg_type))
        if frame.msg_type is not expect or frame.payload_len != payload_len:
            self.close()
            raise FrameError(
                f"KV server {self.address} answered {frame.msg_type.name} with "
                f"{frame.payload_len} payload bytes; expected {expect.name} with "
                f"{payload_len}"
            )
        return frame.meta

    def recv_into(self, view: memoryview) -> None:
        """Read the next `len(view)` payload bytes of the current DATA frame."""
        assert self._sock is not None, "recv_into outside a DATA response"
        try:
            recv_payload_into(self._sock, view, self._session)
        except (FrameError, OSError) as exc:
            self.close()
            raise _failure(self.address, exc) from None

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
            self._session = None
            self._hello = None

    def _connected(self) -> socket.socket:
        if self._sock is not None and _is_stale(self._sock):
            self.close()
        if self._sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), self._timeout)
            except OSError as exc:
                raise KVTransferError(f"cannot reach KV server {self.address}: {exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._wrap(sock)
            self._sock = sock
            if self._secret is not None:
                self._authenticate(sock)
        return self._sock

    def _wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        try:
            return self._tls.wrap_socket(sock)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise KVAuthError(
                f"KV server {self.address}: no TLS session under this deployment's CA ({exc})"
            ) from None

    def _authenticate(self, sock: socket.socket) -> None:
        """The handshake of wire.py on a new connection; closes it on any failure."""
        ours = new_nonce()
        try:
            challenge = self._exchange(
                sock, MessageType.HELLO, {"nonce": ours}, MessageType.CHALLENGE
            )
            theirs = get_str(challenge, "nonce", "CHALLENGE", max_len=64)
            if not is_proof(challenge.get("proof"), self._secret, "server", ours, theirs):
                raise KVAuthError(
                    f"KV server {self.address} failed to prove membership: it holds another "
                    "deployment's secret"
                )
            # AUTH is the last frame in clear; the server seals its answer.
            self._send(
                sock, MessageType.AUTH, {"proof": proof(self._secret, "client", theirs, ours)}
            )
            self._session = Session(self._secret, ours, theirs, is_client=True)
            self._hello = self._answer(sock, MessageType.REPLY)
        except BaseException:
            self.close()
            raise

    def _raise_remote_error(self, meta: dict[str, Any]) -> None:
        code = meta.get("code")
        message = get_str(meta, "error", "ERROR", required=False, max_len=4096) or "no reason"
        if code != "lease":
            self.close()  # the server closes after any other error
        error_type = _ERROR_CODES.get(code, KVTransferError)
        raise error_type(f"KV server {self.address} refused: {message}")


def _is_stale(sock: socket.socket) -> bool:
    # Between requests nothing may arrive: a readable socket means EOF (server idle timeout
    # or restart) or garbage, either way unusable.
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _membership_mismatch(address: str, answer: MessageType) -> str:
    if answer is MessageType.CHALLENGE:
        return (
            f"KV server {address} admits only members of its deployment, and this worker "
            "holds no fleet secret"
        )
    return f"KV server {address} holds no fleet secret: not a member of this deployment"


def _failure(address: str, exc: BaseException) -> KVTransferError:
    if isinstance(exc, FrameError):
        return FrameError(f"KV server {address} sent a bad frame: {exc}")
    if isinstance(exc, ConnectionClosed):
        return KVTransferError(f"KV server {address} closed the connection")
    return KVTransferError(f"KV transfer with {address} failed: {exc}")


def release_over(client: KVClient, params: KVTransferParams) -> bool:
    """RELEASE the lease `params` name; True iff it was still live (which confirms every
    block fetched under it)."""
    reply = client.call(
        MessageType.RELEASE,
        {
            "request_id": params.remote_request_id,
            "engine_id": params.remote_engine_id,
            "block_ids": list(params.remote_block_ids),
        },
    )
    released = reply.get("released")
    if not isinstance(released, bool):
        raise KVProtocolError("RELEASE reply.released must be a boolean")
    return released


def release_lease(
    params: KVTransferParams,
    timeout: float,
    secret: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> bool:
    """`release_over` a one-off connection: RELEASE needs no layout agreement, so a worker
    that refused the KV, or a router whose decode leg never took it, can free it (with the
    fleet `secret` and `tls` where the deployment has them)."""
    client = KVClient(params.remote_host, params.remote_port, timeout, secret, tls)
    try:
        return release_over(client, params)
    finally:
        client.close()
