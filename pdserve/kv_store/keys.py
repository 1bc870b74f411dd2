"""Store keys: a block's chained hash, salted with what its bytes mean and whose they are.

A block's KV depends on every token before it, which the chained block hash covers
(`core.block_manager.chained_block_hash`: BLAKE2b, the same in every process, host and run).
Its bytes also depend on the model and the cache layout, and a tenant's prompts must not be
readable under another tenant's keys, so the key salts the hash with the `LayoutFingerprint`
and the namespace::

    pdserve:kv:[<namespace>:]<salt: 16 hex>:<block hash: 16 hex>
    salt = BLAKE2b-64(value format version, namespace, fingerprint digest)
      or, with a namespace secret, HMAC-SHA256(secret, the same)[:8 bytes]

The namespace is in the key so that a Redis ACL user can be held to its tenant's keys
(``~pdserve:kv:<namespace>:*``: it can neither read nor write another's); the secret
(`--kv-store-namespace-secret-file`) makes the salt unguessable, so whoever knows a
namespace's name but not its secret cannot compute its keys (nor probe whether a prompt is
stored there, nor name the `local` store's segment in advance).

The value repeats the fingerprint, the hashes and the token ids (`codec.py`), so a key that
collides or is overwritten reads as a miss, never as someone else's KV.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.kv_transfer.protocol import DTYPE_ITEMSIZE, KVLayout

# Bump on any change to the value format (`codec.py`) or to the fingerprint's fields: old
# values then live under other keys and are never read.
VALUE_FORMAT_VERSION = 1
KEY_PREFIX = "pdserve:kv:"
# What a namespace may hold: it is part of keys and of Redis ACL key patterns (no ':' and no
# glob characters).
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_.-]*")
# model_identity reads this many evenly spread samples of each weight file, of this size.
_NUM_SAMPLES = 64
_SAMPLE_BYTES = 64 << 10
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def model_identity(name: str, path: Path) -> str:
    """`name` and a digest of the checkpoint at `path` (a file, or a folder's config and
    weight files): two checkpoints that share a name but not weights (a fine-tune) get
    different identities, so their blocks never mix.

    Reads each weight file's size and 64 evenly spread 64 KB samples (4 MB, not the whole
    file: startup stays fast on large models); two checkpoints equal in all of those but
    different elsewhere would need separate `--kv-store-namespace`s.
    """
    files = (
        [path]
        if path.is_file()
        else sorted(
            p for p in path.iterdir() if p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES
        )
    )
    digest = hashlib.blake2b(digest_size=8)
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as f:
            for i in range(_NUM_SAMPLES):
                f.seek(max(size - _SAMPLE_BYTES, 0) * i // (_NUM_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return f"{name}@{digest.hexdigest()}"


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that must agree for a stored block's bytes to be usable as-is.

    A block's payload is ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` of
    `kv_dtype`, C-contiguous (K then V per layer).
    """

    model_id: str  # the weights' identity: same id, same KV for the same tokens
    dtype: str  # the model's compute dtype
    kv_dtype: str  # the cache's element type
    quantization: str | None  # weight quantization, which changes the KV a model computes
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kv_dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"kv_dtype must be one of {sorted(DTYPE_ITEMSIZE)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_layout(
        cls, layout: KVLayout, dtype: str, quantization: str | None
    ) -> LayoutFingerprint:
        """The fingerprint of a KV transfer layout (whose dtype is the cache's) for a model
        computing in `dtype` with weights quantized as `quantization`."""
        return cls(
            model_id=layout.model_id,
            dtype=dtype,
            kv_dtype=layout.dtype,
            quantization=quantization,
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
        )

    @property
    def payload_nbytes(self) -> int:
        """Bytes of one block's K and V over all layers."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.block_size * DTYPE_ITEMSIZE[self.kv_dtype]

    def digest(self) -> bytes:
        """16 bytes that differ whenever any field does (same on every host and run)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class BlockRef:
    """One full block of a request, as the store names and checks it."""

    block_hash: int
    parent_hash: int | None  # None for a sequence's first block
    token_ids: tuple[int, ...]


def block_refs(
    block_hashes: Sequence[int], token_ids: Sequence[int], block_size: int, start: int, stop: int
) -> list[BlockRef]:
    """Blocks `[start, stop)` of a sequence from its chained hashes (`Request.block_hashes`)
    and its tokens."""
    return [
        BlockRef(
            block_hashes[i],
            block_hashes[i - 1] if i else None,
            tuple(token_ids[i * block_size : (i + 1) * block_size]),
        )
        for i in range(start, stop)
    ]


class KeyScheme:
    """Maps block hashes to store keys for one fingerprint and namespace (and the namespace's
    secret, if it has one)."""

    def __init__(
        self, fingerprint: LayoutFingerprint, namespace: str = "", secret: str | None = None
    ) -> None:
        if not NAMESPACE_PATTERN.fullmatch(namespace):  # KVStoreConfig names the flag
            raise ValueError(f"a namespace may hold only [A-Za-z0-9_.-]: {namespace!r}")
        self.fingerprint = fingerprint
        self.fingerprint_digest = fingerprint.digest()
        encoded = namespace.encode()
        # Length-prefixed, so no namespace is a prefix-shift of another.
        message = b"".join(
            (
                VALUE_FORMAT_VERSION.to_bytes(4, "little"),
                len(encoded).to_bytes(4, "little") + encoded,
                self.fingerprint_digest,
            )
        )
        if secret:
            self.salt = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()[:16]
        else:
            self.salt = hashlib.blake2b(
                message, digest_size=8, person=b"pdserve-kvstore"
            ).hexdigest()
        tenant = f"{namespace}:" if namespace else ""
        self._prefix = f"{KEY_PREFIX}{tenant}{self.salt}:".encode()

    def key(self, block_hash: int) -> bytes:
        return self._prefix + f"{block_hash:016x}".encode()

    def keys(self, blocks: Sequence[BlockRef]) -> list[bytes]:
        return [self.key(b.block_hash) for b in blocks]
