"""`RedisBackend`: the store on a Redis (or Valkey) server, shared by workers on any host.

One pipelined round trip per batch (EXISTS per key for lookups, GET per key for reads, SET
per key for writes). A write to come is announced by an in-flight marker, ``<key>:pending``, that
expires on its own (a writer killed before its write landed leaves nothing lasting) and is
deleted with the write.

Reads (`read_into`) bypass redis-py's reply parser: the GETs go out pipelined on one of its
pooled connections (so its connect, AUTH, SELECT and TLS apply), and each reply's bulk string
is received straight into the caller's views (the KV cache's rows) with one scatter
`recvmsg_into` per arrival, not into a reply buffer, then a bytes object, then the cache.
Only reply lines (``$<length>``) and the few bytes read past them go through a small buffer.
Any failure mid-read disconnects that connection (its replies are out of step), and the next
call dials a fresh one. redis-py's own retries are off: a failure surfaces at once as
`StoreUnavailable`, and `KVStore` backs off before trying again, so a down server costs each
request one fast miss, not a stall. A broken connection is dropped by redis-py's pool and the
next call dials again: that is the reconnect.
"""

from __future__ import annotations

import socket
import ssl
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
# Bytes asked of the socket for a reply line: one bulk string's ``$<length>\r\n`` and a little
# of its value (copied on from the buffer): small, so nearly all of a value lands in place.
_LINE_READ_SIZE = 64
# Views handed to one recvmsg_into (Linux's IOV_MAX is 1024).
_MAX_IOV = 512


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
                # RESP2: `_Replies` reads its replies (no RESP3 pushes between them).
                protocol=2,
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

    def read_into(
        self, keys: Sequence[bytes], targets: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        return self._call(lambda: self._read_into(keys, targets)) if keys else []

    def _read_into(
        self, keys: Sequence[bytes], targets: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        pool = self._client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands([("GET", k) for k in keys]))
            replies = _Replies(connection._sock)
            value_nbytes = sum(len(v) for v in targets[0])  # every target's (one layout)
            return [replies.read_bulk_into(views, value_nbytes) for views in targets]
        except TimeoutError:  # the socket's, not redis-py's
            connection.disconnect()
            raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

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


class _Replies:
    """RESP2 replies to pipelined GETs, read off `sock` in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # A TLS socket has no scatter read: it fills one view per call.
        self._can_scatter = not isinstance(sock, ssl.SSLSocket)
        self._buffer = bytearray()  # received past the last reply line

    def read_bulk_into(self, views: Sequence[memoryview], value_nbytes: int) -> int | None:
        """One GET's reply into `views`, of `value_nbytes` in all (see
        `KVStoreBackend.read_into`): its length, or None for a missing key."""
        line = self._read_line()
        if line == b"_":  # RESP3's null, should a server answer in it
            return None
        if line[:1] == b"-":
            raise redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise redis.exceptions.InvalidResponse(f"not a bulk string reply: {line[:32]!r}")
        length = int(line[1:])
        if length < 0:
            return None
        crlf = memoryview(bytearray(2))
        if length == value_nbytes:
            self._read_exactly([*views, crlf])
        else:  # not a block's value: its head is enough for the caller to say what it is
            value = memoryview(bytearray(length))
            self._read_exactly([value, crlf])
            head = views[0][:length]
            head[:] = value[: len(head)]
        if crlf != b"\r\n":
            raise redis.exceptions.InvalidResponse("a bulk string not ended by CRLF")
        return length

    def _read_line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            chunk = self._sock.recv(_LINE_READ_SIZE)
            if not chunk:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _read_exactly(self, views: list[memoryview]) -> None:
        """Fill every view of `views` (which this consumes), in order: first from the buffer,
        then off the socket."""
        i = 0  # views[:i] are full; views[i] is what is left of the next one
        while i < len(views) and self._buffer:
            n = min(len(views[i]), len(self._buffer))
            views[i][:n] = self._buffer[:n]
            del self._buffer[:n]
            i = _advance(views, i, n)
        while i < len(views):
            if self._can_scatter:
                n = self._sock.recvmsg_into(views[i : i + _MAX_IOV])[0]
            else:
                n = self._sock.recv_into(views[i])
            if not n:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            i = _advance(views, i, n)


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """`n` more bytes were received into `views` from `views[i]` on: the index of the first
    view not yet full (what is left of it replacing it)."""
    while n:
        size = len(views[i])
        if n < size:
            views[i] = views[i][n:]
            return i
        n -= size
        i += 1
    return i
