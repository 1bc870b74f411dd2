"""`KVStoreBackend`: bytes by key, the one interface the Redis and the embedded store share.

Backends are thread-safe (the engine thread looks up, a fetch thread reads, the write-behind
thread writes) and raise only `StoreUnavailable` for a failed operation; the `KVStore` in
front of them turns that into misses, counts it and backs off.

Each is registered by the URL scheme of `--kv-store` that names it, by module and class
name (`kv_store.config.register_backend`, as vLLM registers its KV connectors): a backend's
module (and what it imports: redis-py) loads only when a URL names it, and it imports this
interface, never the other way round.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pdserve.kv_store.config import KVStoreConfig


class Presence(enum.Enum):
    ABSENT = "absent"
    # Not stored yet, but a writer announced it (`mark_pending`) and has not landed it.
    PENDING = "pending"
    PRESENT = "present"


class KVStoreBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` are present, in one round trip."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of `keys` (None where absent), in one round trip."""

    def read_into(
        self, keys: Sequence[bytes], targets: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Read the value of `keys[i]` into `targets[i]` (views filled in order, whose sizes
        add up to the length a value should have, the same for every target: one layout),
        in one round trip; returns each value's
        length (None: absent). A value of another length fills only the first view, as far
        as it goes (its head, to tell what it is), and is reported by its length.

        This default copies out of `get_many`; a backend that can read straight into the
        views (`RedisBackend`) does."""
        lengths: list[int | None] = []
        for value, views in zip(self.get_many(keys), targets, strict=True):
            if value is not None:
                _scatter(memoryview(value), views)
            lengths.append(None if value is None else len(value))
        return lengths

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> None:
        """Store each (key, value), replacing what is there, in one round trip."""

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove `keys` (absent ones are ignored)."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: KVStoreConfig, salt: str, value_nbytes: int) -> KVStoreBackend:
        """The backend `config.url` names. `salt` names the embedded store's segment (one per
        namespace and layout), whose slots hold `value_nbytes` each."""

    def presence_many(self, keys: Sequence[bytes]) -> list[Presence]:
        """Per key: stored, announced by a writer, or neither; in one round trip. A backend
        without in-flight markers (writes that land at once) answers from `exists_many`."""
        return [Presence.PRESENT if found else Presence.ABSENT for found in self.exists_many(keys)]

    def mark_pending(self, keys: Sequence[bytes], ttl_s: float) -> None:  # noqa: B027
        """Announce writes of `keys` to come: `presence_many` says PENDING for each absent one
        until it is written or `ttl_s` has passed (a writer that died announces nothing)."""

    def close(self) -> None:  # noqa: B027 - a backend without resources needs no close
        """Release connections or mappings."""


def _scatter(value: memoryview, views: Sequence[memoryview]) -> None:
    """Copy `value` into `views` in order if it fills them exactly, else only its head into
    the first."""
    if len(value) != sum(len(v) for v in views):
        head = views[0][: len(value)]
        head[:] = value[: len(head)]
        return
    offset = 0
    for view in views:
        view[:] = value[offset : offset + len(view)]
        offset += len(view)


def create_backend(config: KVStoreConfig, salt: str, value_nbytes: int) -> KVStoreBackend:
    """The backend `config.url` names (its scheme is a registered one: `KVStoreConfig`
    checked it)."""
    module, class_name = config.backend
    backend = getattr(importlib.import_module(module), class_name)
    return backend.from_config(config, salt, value_nbytes)
