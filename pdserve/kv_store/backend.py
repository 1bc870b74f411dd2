"""`KVStoreBackend`: bytes by key, the one interface the Redis and the embedded store share.

Backends are thread-safe (the engine thread looks up, a fetch thread reads, the write-behind
thread writes) and raise only `StoreUnavailable` for a failed operation; the `KVStore` in
front of them turns that into misses, counts it and backs off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar


class KVStoreBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` are present, in one round trip."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of `keys` (None where absent), in one round trip."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> None:
        """Store each (key, value), replacing what is there, in one round trip."""

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove `keys` (absent ones are ignored)."""

    def close(self) -> None:  # noqa: B027 - a backend without resources needs no close
        """Release connections or mappings."""
