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
with its `ErrorKind`), which the caller treats as a miss.
"""

from __future__ import annotations

import struct
import zlib

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
    return memoryview(value)[HEADER.size + 4 * block_size :]


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


def decode_block(
    value: bytes, fingerprint_digest: bytes, block: BlockRef, payload_nbytes: int
) -> memoryview:
    """The payload of `value` if it is `block` written under `fingerprint_digest`; raises
    `ValueRejected` otherwise. The view shares `value`'s memory."""
    view = memoryview(value)
    tokens = _token_bytes(block.token_ids)
    expected_len = HEADER.size + len(tokens) + payload_nbytes
    if len(view) < HEADER.size:
        raise ValueRejected(ErrorKind.TRUNCATED, f"{len(view)}-byte value is shorter than a header")
    magic, version, _, digest, block_hash, parent_hash, num_tokens, checksum = HEADER.unpack_from(
        view
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
    if len(view) < expected_len:
        raise ValueRejected(ErrorKind.TRUNCATED, f"{len(view)} of {expected_len} bytes")
    if len(view) > expected_len:
        raise ValueRejected(ErrorKind.CORRUPT, f"{len(view)} bytes, expected {expected_len}")
    if (
        block_hash != block.block_hash
        or parent_hash != (block.parent_hash or 0)
        or view[HEADER.size : HEADER.size + len(tokens)] != tokens
    ):
        raise ValueRejected(ErrorKind.MISMATCH, "another block's value under this key")
    if _checksum(view) != checksum:
        raise ValueRejected(ErrorKind.CORRUPT, "checksum mismatch")
    return view[HEADER.size + len(tokens) :]


def _checksum(view: memoryview) -> int:
    """CRC-32 (~6 GB/s on one core: cheap beside the read) of a value, its checksum field
    read as zero."""
    crc = zlib.crc32(view[:_CHECKSUM_OFFSET])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(view[HEADER.size :], crc)
