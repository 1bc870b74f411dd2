"""`RedisBackend`: the store on a Redis (or Valkey) server, shared by workers on any host.

One pipelined round trip per batch (EXISTS per key for lookups, MGET for reads, SET per key
for writes). A write to come is announced by an in-flight marker, ``<key>:pending``, that
expires on its own (a writer killed before its write landed leaves nothing lasting) and is
deleted with the write. redis-py's own retries are off: a failure surfaces at once as
`StoreUnavailable`, and `KVStore` backs off before trying again, so a down server costs each
request one fast miss, not a stall. A broken connection is dropped by redis-py's pool and the
next call dials again: that is the reconnect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.kv_store.backend import KVStoreBackend, Presence
from pdserve.kv_store.config import KVStoreConfig
from pdserve.kv_store.errors import ErrorKind, StoreUnavailable

T = TypeVar("T")
# Bytes asked of the socket per read: a KV block is hundreds of KB, 32 KB reads are many
# syscalls per value.
_SOCKET_READ_SIZE = 1 << 20
_PENDING_SUFFIX = b":pending"


class RedisBackend(KVStoreBackend):
    name = "redis"

    @classmethod
    def from_config(cls, config: KVStoreConfig, salt: str, value_nbytes: int) -> RedisBackend:
        return cls(config)

    def __init__(self, config: KVStoreConfig) -> None:
        self._where = config.redacted_url
        try:
            self._client = redis.Redis.from_url(
                config.url,
                password=config.password,
                socket_timeout=config.timeout_s,
                socket_connect_timeout=config.timeout_s,
                socket_read_size=_SOCKET_READ_SIZE,
                retry=Retry(NoBackoff(), 0),
                client_name="pdserve-kv-store",
            )
        except ValueError as exc:  # a URL redis-py cannot read; its message has no password
            raise ValueError(f"--kv-store {self._where}: {exc}") from None

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        return [bool(n) for n in self._call(run)] if keys else []

    def presence_many(self, keys: Sequence[bytes]) -> list[Presence]:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
                pipe.exists(key + _PENDING_SUFFIX)
            return pipe.execute()

        if not keys:
            return []
        found = self._call(run)
        return [
            Presence.PRESENT if stored else Presence.PENDING if pending else Presence.ABSENT
            for stored, pending in zip(found[::2], found[1::2], strict=True)
        ]

    def mark_pending(self, keys: Sequence[bytes], ttl_s: float) -> None:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.set(key + _PENDING_SUFFIX, b"", px=ttl_ms)
            return pipe.execute()

        ttl_ms = max(int(ttl_s * 1000), 1)
        if keys:
            self._call(run)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._call(lambda: self._client.mget(keys)) if keys else []

    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> None:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value)
                pipe.delete(key + _PENDING_SUFFIX)
            return pipe.execute()

        if items:
            self._call(run)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(lambda: self._client.delete(*keys))

    def close(self) -> None:
        self._client.close()

    def _call(self, run: Callable[[], T]) -> T:
        try:
            return run()
        except redis.exceptions.TimeoutError as exc:
            raise StoreUnavailable(ErrorKind.TIMEOUT, f"{self._where}: {exc}") from None
        except redis.exceptions.ConnectionError as exc:  # includes authentication failures
            raise StoreUnavailable(ErrorKind.CONNECTION, f"{self._where}: {exc}") from None
        except redis.exceptions.RedisError as exc:
            raise StoreUnavailable(ErrorKind.SERVER, f"{self._where}: {exc}") from None
        except OSError as exc:  # a socket error redis-py did not wrap
            raise StoreUnavailable(ErrorKind.CONNECTION, f"{self._where}: {exc}") from None
