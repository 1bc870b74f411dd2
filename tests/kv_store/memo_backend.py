"""A `KVStoreBackend` in a dict, registered by a test (`test_format.py`) as `memo://`."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kv_store.backend import KVStoreBackend
from pdserve.kv_store.config import KVStoreConfig


class MemoBackend(KVStoreBackend):
    name = "memo"

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}

    @classmethod
    def from_config(cls, config: KVStoreConfig, salt: str, value_nbytes: int) -> MemoBackend:
        return cls()

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._values for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._values.get(key) for key in keys]

    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> None:
        self._values.update((key, bytes(value)) for key, value in items)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._values.pop(key, None)
