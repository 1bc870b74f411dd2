"""Typed field access for untrusted JSON objects (kv_transfer_params, frame metadata).

One mechanism for every decoder in this package: each getter checks presence and type and
raises `KVProtocolError` naming `where.key`, so a hostile or buggy peer gets a clear refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.kv_transfer.errors import KVProtocolError

_MISSING = object()


def _raw(data: Mapping[str, Any], key: str, where: str, required: bool) -> Any:
    value = data.get(key, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise KVProtocolError(f"{where}.{key} is required")
        return None
    return value


def get_bool(data: Mapping[str, Any], key: str, where: str, *, default: bool = False) -> bool:
    value = _raw(data, key, where, required=False)
    if value is None:
        return default
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
