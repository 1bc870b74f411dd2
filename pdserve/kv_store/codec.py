"""The stored value of one KV block: a small versioned header, the token ids, raw bytes.
Never pickle, never eval: a value is only ever compared and copied.

Layout (little-endian)::

    magic         b"PDKS"   4 bytes
    version       u16       VALUE_FORMAT_VERSION
    reserved      u16       0
    fingerprint   16 bytes  LayoutFingerprint.digest() of the writer
    block_hash    u64       the block's chained hash
    parent_hash   u64       the previous block's (0 for a first block, as the hash chain does)
    num_tokens    u32       = block_size
    checksum      u32       CRC-32 of every other byte of the value
    token_ids     num_tokens x u32
    payload       LayoutFingerprint.payload_nbytes raw bytes: [layers, 2, block, heads, dim]

A reader checks, cheapest first: length, magic, version, fingerprint, hashes and token ids
against the request's, then the checksum; any failure rejects the value (`ValueRejected`
with its `ErrorKind`), which the caller treats as a miss. `check_value` does it on a value
read in parts (its head, then its payload straight into the KV cache's rows, without
assembling it); `decode_block` on one buffer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

# ISA-L's CRC-32 (the zlib polynomial, so values are unchanged): ~28 GB/s on one core with
# carry-less multiply, 6x zlib's here, so checking costs far less than the read.
from isal.isal_zlib import crc32

from pdserve.kv_store.errors import ErrorKind, ValueRejected
from pdserve.kv_store.keys import VALUE_FORMAT_VERSION, BlockRef

MAGIC = b"PDKS"
HEADER = struct.Struct("<4sHH16sQQII")
_CHECKSUM_OFFSET = HEADER.size - 4


def _token_bytes(token_ids: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def value_nbytes(block_size: int, payload_nbytes: int) -> int:
    return HEADER.size + 4 * block_size + payload_nbytes


def new_value(fingerprint_digest: bytes, block: BlockRef, payload_nbytes: int) -> bytearray:
    """A value for `block` with its payload zeroed: fill `payload_view()`, then `seal()`.

    Lets a writer copy the KV straight from the cache into the value (one copy)."""
    value = bytearray(value_nbytes(len(block.token_ids), payload_nbytes))
    HEADER.pack_into(
        value,
        0,
        MAGIC,
        VALUE_FORMAT_VERSION,
        0,
        fingerprint_digest,
        block.block_hash,
        block.parent_hash or 0,
        len(block.token_ids),
        0,
    )
    value[HEADER.size : HEADER.size + 4 * len(block.token_ids)] = _token_bytes(block.token_ids)
    return value


def payload_view(value: bytearray, block_size: int) -> memoryview:
    return memoryview(value)[head_nbytes(block_size) :]


def seal(value: bytearray) -> bytearray:
    """Write the checksum of a filled value; returns it."""
    view = memoryview(value)
    view[_CHECKSUM_OFFSET : HEADER.size] = _checksum(view).to_bytes(4, "little")
    return value


def encode_block(fingerprint_digest: bytes, block: BlockRef, payload: bytes | memoryview) -> bytes:
    """The stored value of `block` whose K and V bytes are `payload`."""
    value = new_value(fingerprint_digest, block, len(payload))
    payload_view(value, len(block.token_ids))[:] = payload
    return bytes(seal(value))


def head_nbytes(block_size: int) -> int:
    """Bytes of a value before its payload: the header and the token ids."""
    return HEADER.size + 4 * block_size


def decode_block(
    value: bytes, fingerprint_digest: bytes, block: BlockRef, payload_nbytes: int
) -> memoryview:
    """The payload of `value` if it is `block` written under `fingerprint_digest`; raises
    `ValueRejected` otherwise. The view shares `value`'s memory."""
    view = memoryview(value)
    split = min(head_nbytes(len(block.token_ids)), len(view))
    payload = view[split:]
    check_value(view[:split], len(view), [payload], fingerprint_digest, block, payload_nbytes)
    return payload


def check_value(
    head: memoryview,
    value_nbytes: int,
    payload_parts: Sequence[memoryview],
    fingerprint_digest: bytes,
    block: BlockRef,
    payload_nbytes: int,
) -> None:
    """Raise `ValueRejected` unless a value of `value_nbytes` whose first bytes are `head` (up
    to `head_nbytes`) and whose payload is `payload_parts`, in order, is `block` written under
    `fingerprint_digest`. The parts are read only when the length is right."""
    tokens = _token_bytes(block.token_ids)
    expected_len = HEADER.size + len(tokens) + payload_nbytes
    if value_nbytes < HEADER.size:
        raise ValueRejected(
            ErrorKind.TRUNCATED, f"{value_nbytes}-byte value is shorter than a header"
        )
    magic, version, _, digest, block_hash, parent_hash, num_tokens, checksum = HEADER.unpack_from(
        head
    )
    if magic != MAGIC:
        raise ValueRejected(ErrorKind.CORRUPT, f"bad magic {bytes(magic)!r}")
    if version != VALUE_FORMAT_VERSION:
        raise ValueRejected(
            ErrorKind.VERSION, f"value format {version}, this worker reads {VALUE_FORMAT_VERSION}"
        )
    if digest != fingerprint_digest:
        raise ValueRejected(ErrorKind.FOREIGN, "written for another model, dtype or layout")
    if num_tokens != len(block.token_ids):
        raise ValueRejected(
            ErrorKind.CORRUPT, f"{num_tokens} tokens, a block has {len(block.token_ids)}"
        )
    if value_nbytes < expected_len:
        raise ValueRejected(ErrorKind.TRUNCATED, f"{value_nbytes} of {expected_len} bytes")
    if value_nbytes > expected_len:
        raise ValueRejected(ErrorKind.CORRUPT, f"{value_nbytes} bytes, expected {expected_len}")
    if (
        block_hash != block.block_hash
        or parent_hash != (block.parent_hash or 0)
        or head[HEADER.size : HEADER.size + len(tokens)] != tokens
    ):
        raise ValueRejected(ErrorKind.MISMATCH, "another block's value under this key")
    if _checksum(head, payload_parts) != checksum:
        raise ValueRejected(ErrorKind.CORRUPT, "checksum mismatch")


def _checksum(head: memoryview, payload_parts: Sequence[memoryview] = ()) -> int:
    """CRC-32 of a value (its head, then its payload parts), the checksum field read as
    zero."""
    crc = crc32(head[:_CHECKSUM_OFFSET])
    crc = crc32(b"\0\0\0\0", crc)
    crc = crc32(head[HEADER.size :], crc)
    for part in payload_parts:
        crc = crc32(part, crc)
    return crc
