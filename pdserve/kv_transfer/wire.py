"""Length-prefixed frames for the KV control and data channel. Never pickle, never eval.

A frame is a fixed 20-byte header, then `meta_len` bytes of UTF-8 JSON (an object), then
`payload_len` raw bytes (tensor data, only in DATA frames)::

    magic  b"PDKV"  4 bytes
    version         u16   KV_TRANSFER_PROTOCOL_VERSION of the sender
    msg_type        u16   MessageType
    meta_len        u32   <= MAX_META_BYTES
    payload_len     u64   <= the reader's limit (0 for every request)

all big-endian. The magic and version fields keep their place in every future version, so a
peer can always read the version and answer with a clear refusal.

Membership (a server started with the deployment's fleet secret): a connection's first request
must be HELLO, answered by a CHALLENGE; only after a right AUTH does the server answer HELLO's
REPLY or serve FETCH and RELEASE. Both sides prove they hold the secret without sending it: an
HMAC-SHA256 over the speaker's role and both sides' fresh nonces (`proof`)::

    client -> HELLO     {nonce: c}
    server -> CHALLENGE {nonce: s, proof: proof(secret, "server", c, s)}
    client -> AUTH      {proof: proof(secret, "client", s, c)}    (after checking the server's)
    server -> REPLY     {protocol_version, engine_id, ...}        (or ERROR unauthorized, closed)

Every frame after AUTH, both ways, from the REPLY on, is sealed by the connection's
`Session`: keys derived from the secret and both nonces (HKDF-SHA256, one key per direction),
and after each frame's payload a 32-byte HMAC-SHA256 tag over a per-direction sequence number,
the header, the metadata and the payload. A frame altered, replayed, reordered, reflected or
moved to another connection fails its tag (`FrameError`): the connection is closed and its
transfer fails (the decode worker's ``--kv-failure-policy`` decides what the request does).

A server without a secret answers HELLO with REPLY at once, as before; peers that both hold no
secret speak exactly the version-1 protocol (no tags).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer.protocol import KV_TRANSFER_PROTOCOL_VERSION, FrameError

MAGIC = b"PDKV"
HEADER = struct.Struct("!4sHHIQ")
MAX_META_BYTES = 1 << 20
# Largest single recv; bounds a recv_into() slice, not a frame.
_RECV_CHUNK = 1 << 22
NONCE_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256
_SEQUENCE = struct.Struct("!Q")


class MessageType(enum.IntEnum):
    # requests (receiver -> sender)
    # {nonce?} -> REPLY {protocol_version, engine_id, layout, num_blocks, ...}, or CHALLENGE
    HELLO = 1
    AUTH = 2  # {proof} -> REPLY (as HELLO's) or ERROR {code: "unauthorized"}
    FETCH = 3  # {request_id, layer_start, layer_end, block_ids} -> DATA
    RELEASE = 4  # {request_id, engine_id, block_ids} -> REPLY {released}
    # {request_id, num_known, wait_s} -> REPLY {block_ids, is_complete, first_token_id,
    # complete_age_s}: a streamed lease's blocks past the first num_known (lease.py)
    WATCH = 5
    # responses (sender -> receiver)
    REPLY = 16
    DATA = 17  # {dtype, shape} + payload: per layer, [2, num_blocks, block_size, heads, dim]
    ERROR = 18  # {code, error}
    CHALLENGE = 19  # {nonce, proof?}: prove membership first (see the module docstring)


REQUEST_TYPES = frozenset(
    {
        MessageType.HELLO,
        MessageType.AUTH,
        MessageType.FETCH,
        MessageType.RELEASE,
        MessageType.WATCH,
    }
)


class ConnectionClosed(Exception):
    """The peer closed the connection cleanly between frames."""


class VersionMismatch(FrameError):
    """A well-formed header from a peer speaking another protocol version."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"peer speaks KV transfer protocol version {version}, "
            f"this worker speaks {KV_TRANSFER_PROTOCOL_VERSION}"
        )
        self.version = version


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(secret: str, speaker: str, *nonces: str) -> str:
    """HMAC-SHA256 (hex) of `speaker` ("server" or "client": a proof is never valid for the
    other side) and the handshake's nonces under the fleet secret."""
    message = "\n".join((speaker, *nonces)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def is_proof(given: object, secret: str, speaker: str, *nonces: str) -> bool:
    """Whether `given` (untrusted) is `proof(secret, speaker, *nonces)`, in constant time."""
    expected = proof(secret, speaker, *nonces)
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


class _Direction:
    """One direction of a session: its key, the next frame's sequence number, and the MAC of
    the frame in progress (its payload still to come: `payload_left` bytes)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._sequence = 0
        self._mac: hmac.HMAC | None = None
        self.payload_left = 0

    def begin(self, header_and_meta: bytes, payload_len: int) -> None:
        self._mac = hmac.new(self._key, _SEQUENCE.pack(self._sequence), hashlib.sha256)
        self._mac.update(header_and_meta)
        self._sequence += 1
        self.payload_left = payload_len

    def update(self, view: memoryview) -> bool:
        """Add payload bytes; True once the frame's payload is complete (its tag is due)."""
        self._mac.update(view)
        self.payload_left -= len(view)
        return self.payload_left == 0

    def tag(self) -> bytes:
        tag, self._mac = self._mac.digest(), None
        return tag


class Session:
    """The frame keys of one authenticated connection (see the module docstring)."""

    def __init__(self, secret: str, client_nonce: str, server_nonce: str, *, is_client: bool):
        # HKDF (RFC 5869): extract with both nonces as the salt, expand once per direction.
        salt = f"{client_nonce}\n{server_nonce}".encode()
        prk = hmac.new(salt, secret.encode(), hashlib.sha256).digest()
        to_server, to_client = (
            hmac.new(prk, label + b"\x01", hashlib.sha256).digest()
            for label in (b"pdserve kv frames to server", b"pdserve kv frames to client")
        )
        self.sending = _Direction(to_server if is_client else to_client)
        self.receiving = _Direction(to_client if is_client else to_server)


@dataclass(frozen=True)
class Frame:
    """A decoded header and metadata; the caller reads `payload_len` bytes next."""

    msg_type: MessageType
    meta: dict[str, Any]
    payload_len: int


def encode_frame(
    msg_type: MessageType,
    meta: dict[str, Any],
    payload_len: int = 0,
    version: int = KV_TRANSFER_PROTOCOL_VERSION,
) -> bytes:
    body = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_META_BYTES:
        raise FrameError(f"frame metadata is {len(body)} bytes, over {MAX_META_BYTES}")
    return HEADER.pack(MAGIC, version, int(msg_type), len(body), payload_len) + body


def send_frame(
    sock: socket.socket,
    msg_type: MessageType,
    meta: dict[str, Any],
    payload_len: int = 0,
    session: Session | None = None,
) -> None:
    """Send header and metadata (and, sealed with no payload, the tag); a DATA sender then
    sends exactly `payload_len` bytes with `send_payload`."""
    frame = encode_frame(msg_type, meta, payload_len)
    if session is None:
        sock.sendall(frame)
        return
    session.sending.begin(frame, payload_len)
    sock.sendall(frame if payload_len else frame + session.sending.tag())


def send_payload(sock: socket.socket, view: memoryview, session: Session | None) -> None:
    """Send the next part of the current frame's payload (and after its last byte, the tag)."""
    sock.sendall(view)
    if session is not None and session.sending.update(view.cast("B")):
        sock.sendall(session.sending.tag())


def recv_payload_into(sock: socket.socket, view: memoryview, session: Session | None) -> None:
    """Receive the next part of the current frame's payload into `view`; after its last
    byte, check the tag."""
    recv_exact_into(sock, view)
    if session is not None and session.receiving.update(view.cast("B")):
        _check_tag(sock, session.receiving)


def _check_tag(sock: socket.socket, direction: _Direction) -> None:
    tag = bytearray(TAG_BYTES)
    recv_exact_into(sock, memoryview(tag))
    if not hmac.compare_digest(bytes(tag), direction.tag()):
        raise FrameError(
            "frame authentication failed: the frame was altered, replayed or reordered on the wire"
        )


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; EOF part-way is a truncated frame."""
    view = view.cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, _RECV_CHUNK))
        if n == 0:
            raise FrameError(f"connection closed mid-frame ({got} of {len(view)} bytes)")
        got += n


def read_frame(sock: socket.socket, max_payload: int, session: Session | None = None) -> Frame:
    """Read one header and its metadata, validating both before allocating anything (and,
    sealed with no payload, checking the tag before the metadata is parsed; a payload is read
    with `recv_payload_into`).

    Raises `ConnectionClosed` on a clean EOF before the header, `VersionMismatch` for a
    foreign version, `FrameError` for anything malformed or failing its tag.
    """
    header = bytearray(HEADER.size)
    first = sock.recv_into(header)
    if first == 0:
        raise ConnectionClosed
    recv_exact_into(sock, memoryview(header)[first:])
    magic, version, raw_type, meta_len, payload_len = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if version != KV_TRANSFER_PROTOCOL_VERSION:
        raise VersionMismatch(version)
    try:
        msg_type = MessageType(raw_type)
    except ValueError:
        raise FrameError(f"unknown message type {raw_type}") from None
    if meta_len > MAX_META_BYTES:
        raise FrameError(f"metadata length {meta_len} over the {MAX_META_BYTES}-byte cap")
    if payload_len > max_payload:
        raise FrameError(f"payload length {payload_len} over this frame's limit {max_payload}")
    body = bytearray(meta_len)
    recv_exact_into(sock, memoryview(body))
    if session is not None:
        session.receiving.begin(bytes(header) + bytes(body), payload_len)
        if not payload_len:
            _check_tag(sock, session.receiving)
    return Frame(msg_type, _decode_meta(body), payload_len)


def _decode_meta(body: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"metadata is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise FrameError(f"metadata must be a JSON object, got {type(meta).__name__}")
    return meta


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")
