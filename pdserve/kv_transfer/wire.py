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

A server without a secret answers HELLO with REPLY at once, as before; peers that both hold no
secret speak exactly the version-1 protocol.
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
    sock: socket.socket, msg_type: MessageType, meta: dict[str, Any], payload_len: int = 0
) -> None:
    """Send header and metadata; a DATA sender then sends exactly `payload_len` bytes."""
    sock.sendall(encode_frame(msg_type, meta, payload_len))


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; EOF part-way is a truncated frame."""
    view = view.cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, _RECV_CHUNK))
        if n == 0:
            raise FrameError(f"connection closed mid-frame ({got} of {len(view)} bytes)")
        got += n


def read_frame(sock: socket.socket, max_payload: int) -> Frame:
    """Read one header and its metadata, validating both before allocating anything.

    Raises `ConnectionClosed` on a clean EOF before the header, `VersionMismatch` for a
    foreign version, `FrameError` for anything malformed.
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
