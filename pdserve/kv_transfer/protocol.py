"""What crosses between a prefill worker and a decode worker, and how it is checked.

The versioned hand-off schema (after vLLM's disaggregated serving, so a router can front
other engines too):

1. The router sends the prefill leg with ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true}``.
2. The prefill worker computes the prompt, leases its KV blocks and answers with
   ``kv_transfer_params`` naming where the blocks are (`KVTransferParams.to_dict()` with
   ``do_remote_prefill: true``).
3. The router sends the decode leg with those params; the decode worker fetches the blocks into
   its own cache, in `KVTransferUnit`s, and tells the prefill worker to release them.

Both ends refuse a different `KV_TRANSFER_PROTOCOL_VERSION`, model, dtype or block layout with
a `KVIncompatibleError` naming what differs. Every decoder of untrusted JSON in this package
(these params, frame metadata) reads it through the typed getters here, which raise
`KVProtocolError` naming ``where.key``; every error a caller can see is a `KVTransferError`.
This module is pure Python (no torch) so the router and the scheduler can use it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pdserve.kv_transfer.registry import offered_transports

# Bump on any change to `KVTransferParams`, `KVLayout` hashing or the wire format (wire.py).
KV_TRANSFER_PROTOCOL_VERSION = 1


# dtype name -> bytes per element.
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# Upper bound on blocks one request may name (a 1M-token prompt at block_size 16 is 65,536).
MAX_BLOCKS_PER_REQUEST = 1 << 20


# ---- errors ------------------------------------------------------------------------------


class KVTransferError(RuntimeError):
    """A KV transfer could not be completed. The subclasses say what went wrong, so the
    connector can choose between recomputing, failing the request, or reporting a bad
    deployment."""


class KVProtocolError(KVTransferError, ValueError):
    """Malformed `kv_transfer_params`, frame or message field; the message names the field."""


class FrameError(KVProtocolError):
    """A wire frame violated the framing rules (bad magic, oversized, truncated, wrong size)."""


class KVIncompatibleError(KVTransferError):
    """The two workers cannot exchange KV: protocol version, model, dtype or block layout differ.

    `differences` lists each mismatch as a human-readable phrase.
    """

    def __init__(self, message: str, differences: list[str] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or [])


class KVLeaseError(KVTransferError):
    """The sender holds no live lease for the request (unknown, released or expired)."""


class KVStreamBroken(KVTransferError):
    """A streamed receive broke off (sender gone, lease ended) after the first
    `num_confirmed_blocks` remote blocks arrived and were confirmed valid."""

    def __init__(self, message: str, num_confirmed_blocks: int) -> None:
        super().__init__(message)
        self.num_confirmed_blocks = num_confirmed_blocks


class KVAuthError(KVTransferError):
    """The peer is not a member of this deployment: it has no fleet secret, or another one
    (see the HELLO handshake in wire.py)."""


# ---- typed field access for untrusted JSON -----------------------------------------------

_MISSING = object()


def _raw(data: Mapping[str, Any], key: str, where: str, required: bool) -> Any:
    value = data.get(key, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise KVProtocolError(f"{where}.{key} is required")
        return None
    return value


def get_bool(data: Mapping[str, Any], key: str, where: str) -> bool:
    value = _raw(data, key, where, required=False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise KVProtocolError(f"{where}.{key} must be a boolean, got {type(value).__name__}")
    return value


def get_int(
    data: Mapping[str, Any],
    key: str,
    where: str,
    *,
    required: bool = True,
    min_value: int = 0,
    max_value: int | None = None,
) -> int | None:
    value = _raw(data, key, where, required)
    if value is None:
        return None
    return check_int(value, f"{where}.{key}", min_value=min_value, max_value=max_value)


def get_float(data: Mapping[str, Any], key: str, where: str, *, max_value: float) -> float:
    """A required number in ``[0, max_value]``."""
    value = _raw(data, key, where, True)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise KVProtocolError(f"{where}.{key} must be a number, got {type(value).__name__}")
    if not 0 <= value <= max_value:
        raise KVProtocolError(f"{where}.{key} must be in [0, {max_value}], got {value}")
    return float(value)


def check_int(value: Any, name: str, *, min_value: int = 0, max_value: int | None = None) -> int:
    # bool is an int subclass; a JSON `true` where a count belongs is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVProtocolError(f"{name} must be an integer, got {type(value).__name__}")
    if value < min_value or (max_value is not None and value > max_value):
        bound = f"[{min_value}, {max_value}]" if max_value is not None else f">= {min_value}"
        raise KVProtocolError(f"{name} must be in {bound}, got {value}")
    return value


def get_str(
    data: Mapping[str, Any], key: str, where: str, *, required: bool = True, max_len: int = 256
) -> str | None:
    value = _raw(data, key, where, required)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise KVProtocolError(f"{where}.{key} must be a non-empty string")
    if len(value) > max_len:
        raise KVProtocolError(f"{where}.{key} is longer than {max_len} characters")
    return value


def get_int_list(
    data: Mapping[str, Any], key: str, where: str, *, max_len: int, max_value: int | None = None
) -> tuple[int, ...]:
    value = _raw(data, key, where, required=True)
    if not isinstance(value, list | tuple):
        raise KVProtocolError(f"{where}.{key} must be a list of integers")
    if len(value) > max_len:
        raise KVProtocolError(f"{where}.{key} has {len(value)} entries, more than {max_len}")
    name = f"{where}.{key}[]"
    return tuple(check_int(v, name, max_value=max_value) for v in value)


def reject_unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise KVProtocolError(f"{where} has unknown field(s): {', '.join(map(str, unknown))}")


# ---- the hand-off: block layout and params -----------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """What a KV block means: the two ends must agree on all of it to exchange raw bytes.

    The cache tensor is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
    one block of one layer's K (or V) is ``[block_size, num_kv_heads, head_dim]``, contiguous.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        _validate_layout_dict(asdict(self), "kv layout")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return math.prod(self.block_shape) * self.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, *self.block_shape)

    def nbytes(self, num_blocks: int, num_layers: int | None = None) -> int:
        """Bytes of K and V for `num_blocks` blocks over `num_layers` layers (default all)."""
        layers = self.num_layers if num_layers is None else num_layers
        return layers * 2 * num_blocks * self.block_nbytes

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def layout_hash(self) -> str:
        """Stable short hash of the layout (same on every host and Python run)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "kv layout") -> KVLayout:
        if not isinstance(data, Mapping):
            raise KVProtocolError(f"{where} must be a JSON object")
        reject_unknown(data, {f.name for f in fields(cls)}, where)
        _validate_layout_dict(data, where)
        return cls(**data)


def _validate_layout_dict(data: Mapping[str, Any], where: str) -> None:
    get_str(data, "model_id", where, max_len=1024)
    for key in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
        get_int(data, key, where, min_value=1, max_value=1 << 20)
    dtype = get_str(data, "dtype", where)
    if dtype not in DTYPE_ITEMSIZE:
        raise KVProtocolError(
            f"{where}.dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {dtype!r}"
        )


def check_compatible(
    local: KVLayout, remote: KVLayout, remote_version: int = KV_TRANSFER_PROTOCOL_VERSION
) -> None:
    """Raise `KVIncompatibleError` naming every difference that forbids a raw-byte transfer."""
    differences = []
    if remote_version != KV_TRANSFER_PROTOCOL_VERSION:
        differences.append(
            f"protocol version differs (local {KV_TRANSFER_PROTOCOL_VERSION}, "
            f"remote {remote_version})"
        )
    if local.model_id != remote.model_id:
        differences.append(f"model differs (local {local.model_id!r}, remote {remote.model_id!r})")
    if local.dtype != remote.dtype:
        differences.append(f"dtype differs (local {local.dtype}, remote {remote.dtype})")
    shape_keys = ("num_layers", "num_kv_heads", "head_dim", "block_size")
    shape_diffs = [
        f"{k} local {getattr(local, k)} remote {getattr(remote, k)}"
        for k in shape_keys
        if getattr(local, k) != getattr(remote, k)
    ]
    if shape_diffs:
        differences.append("block layout differs (" + ", ".join(shape_diffs) + ")")
    if differences:
        raise KVIncompatibleError("KV transfer refused: " + "; ".join(differences), differences)


def check_protocol_version(version: int, where: str) -> None:
    if version != KV_TRANSFER_PROTOCOL_VERSION:
        raise KVIncompatibleError(
            f"{where}: KV transfer protocol version {version} is not supported "
            f"(this worker speaks version {KV_TRANSFER_PROTOCOL_VERSION})",
            [f"protocol version differs (local {KV_TRANSFER_PROTOCOL_VERSION}, remote {version})"],
        )


@dataclass(frozen=True)
class KVTransferParams:
    """vLLM-style ``kv_transfer_params`` carried by the router between the two legs.

    Prefill leg (router -> prefill worker): ``{"do_remote_decode": true}``, nothing else.
    Decode leg (prefill worker -> router -> decode worker), all required unless noted:

    ====================  =====================================================================
    do_remote_prefill     true
    remote_engine_id      the prefill engine's id (a restarted worker has a new one)
    remote_request_id     the lease key on the prefill worker
    remote_host/port      the prefill worker's KV server (control channel; tcp data too)
    remote_block_ids      block ids holding the KV, in token order
    remote_num_tokens     tokens of KV in those blocks (the prompt length);
                          ``len(remote_block_ids) == ceil(remote_num_tokens / block_size)``
    transport             "shm" (same host) or "tcp"
    shm_name              the prefill worker's shared KV segment (shm only)
    layout_hash           `KVLayout.layout_hash()` of the prefill worker's cache
    protocol_version      `KV_TRANSFER_PROTOCOL_VERSION` of the prefill worker
    first_token_id        optional: the token the prefill leg sampled
    is_streamed           optional: the KV is announced chunk by chunk as the prefill worker
                          computes it (a streamed lease, lease.py): `remote_block_ids` is
                          empty, no `first_token_id`; the receiver WATCHes for both
    ====================  =====================================================================

    A streamed prefill leg is ``{"do_remote_decode": true, "is_streamed": true}``: its worker
    announces the decode leg's params at admission, before computing.

    Unknown fields are refused (the version is bumped instead).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: tuple[int, ...] = field(default_factory=tuple)
    remote_num_tokens: int = 0
    transport: str | None = None
    shm_name: str | None = None
    layout_hash: str | None = None
    protocol_version: int = KV_TRANSFER_PROTOCOL_VERSION
    first_token_id: int | None = None
    is_streamed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        _validate_params_dict(self.to_dict(), "kv_transfer_params")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (block ids as a list)."""
        data = asdict(self)
        data["remote_block_ids"] = list(self.remote_block_ids)
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "kv_transfer_params") -> KVTransferParams:
        """Validate untrusted JSON; raises `KVProtocolError` / `KVIncompatibleError`."""
        if not isinstance(data, Mapping):
            raise KVProtocolError(f"{where} must be a JSON object")
        reject_unknown(data, {f.name for f in fields(cls)}, where)
        _validate_params_dict(data, where)
        values = {k: v for k, v in data.items() if v is not None}
        return cls(**values)


def _validate_params_dict(data: Mapping[str, Any], where: str) -> None:
    do_remote_decode = get_bool(data, "do_remote_decode", where)
    do_remote_prefill = get_bool(data, "do_remote_prefill", where)
    if do_remote_decode and do_remote_prefill:
        raise KVProtocolError(f"{where}: do_remote_decode and do_remote_prefill are exclusive")
    # The decode leg must carry the version its producer spoke; the prefill leg may omit it.
    version = get_int(data, "protocol_version", where, required=do_remote_prefill)
    if version is not None:
        check_protocol_version(version, where)
    get_str(data, "remote_engine_id", where, required=do_remote_prefill)
    get_str(data, "remote_request_id", where, required=do_remote_prefill, max_len=1024)
    get_str(data, "remote_host", where, required=do_remote_prefill)
    get_int(data, "remote_port", where, required=do_remote_prefill, min_value=1, max_value=65535)
    get_str(data, "layout_hash", where, required=do_remote_prefill)
    if data.get("remote_block_ids") is not None:
        get_int_list(data, "remote_block_ids", where, max_len=MAX_BLOCKS_PER_REQUEST)
    get_int(data, "remote_num_tokens", where, required=False)
    get_int(data, "first_token_id", where, required=False)
    is_streamed = get_bool(data, "is_streamed", where)
    transport = get_str(data, "transport", where, required=do_remote_prefill)
    if transport is not None and transport not in offered_transports():
        raise KVProtocolError(
            f"{where}.transport must be one of {list(offered_transports())}, got {transport!r}"
        )
    get_str(data, "shm_name", where, required=do_remote_prefill and transport == "shm")
    if do_remote_prefill:
        _validate_hand_off(data, where, is_streamed)


def _validate_hand_off(data: Mapping[str, Any], where: str, is_streamed: bool) -> None:
    if not is_streamed and not data.get("remote_block_ids"):
        raise KVProtocolError(f"{where}.remote_block_ids must name at least one block")
    if not data.get("remote_num_tokens"):
        raise KVProtocolError(f"{where}.remote_num_tokens must be at least 1")
    block_ids = data.get("remote_block_ids") or []
    if len(set(block_ids)) != len(block_ids):
        raise KVProtocolError(f"{where}.remote_block_ids has duplicates")


# ---- transfer units ----------------------------------------------------------------------
# A whole-request transfer is one unit covering every layer. The same type expresses the
# overlapped transfers to come: one unit per layer (or layer group) as prefill finishes that
# layer, or one unit per prompt chunk's blocks as chunked prefill completes them.


@dataclass(frozen=True)
class KVTransferUnit:
    """Layers ``[layer_start, layer_end)`` of blocks: ``remote_block_ids[i]`` on the sender
    goes to ``local_block_ids[i]`` on the receiver, for K and V."""

    layer_start: int
    layer_end: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        object.__setattr__(self, "local_block_ids", tuple(self.local_block_ids))
        check_int(self.layer_start, "unit.layer_start")
        check_int(self.layer_end, "unit.layer_end", min_value=self.layer_start + 1)
        if len(self.remote_block_ids) != len(self.local_block_ids):
            raise KVProtocolError(
                f"unit has {len(self.remote_block_ids)} remote block ids but "
                f"{len(self.local_block_ids)} local block ids"
            )
        if not self.remote_block_ids:
            raise KVProtocolError("unit names no blocks")
        for name, ids in (("remote", self.remote_block_ids), ("local", self.local_block_ids)):
            for block_id in ids:
                check_int(block_id, f"unit.{name}_block_ids[]")
            if len(set(ids)) != len(ids):
                raise KVProtocolError(f"unit.{name}_block_ids has duplicates")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)


def plan_units(
    num_layers: int,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    layers_per_unit: int | None = None,
) -> list[KVTransferUnit]:
    """Split a request's transfer into units: one for all layers (`layers_per_unit` None),
    else consecutive layer groups of that size."""
    step = num_layers if layers_per_unit is None else layers_per_unit
    check_int(step, "layers_per_unit", min_value=1)
    return [
        KVTransferUnit(
            start, min(start + step, num_layers), tuple(remote_block_ids), tuple(local_block_ids)
        )
        for start in range(0, num_layers, step)
    ]
