"""What can go wrong between an engine and its KV store, by kind (the `kind` label of
`pdserve:kv_store_errors_total`). Every kind is a miss to the caller, never an error: the
store is an accelerator, and a request whose blocks cannot be read is computed instead."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    # The backend failed: the request's blocks are recomputed, writes are dropped.
    CONNECTION = "connection"  # refused, reset, DNS, TLS, authentication
    TIMEOUT = "timeout"  # no answer within --kv-store's timeout
    SERVER = "server"  # the server answered an error (out of memory, wrong type, ...)
    FULL = "full"  # the embedded store could not find room for a write
    # A value was read but is not the block asked for: it is ignored (and deleted).
    TRUNCATED = "truncated"  # shorter than its header says
    CORRUPT = "corrupt"  # bad magic, bad lengths or a checksum mismatch
    VERSION = "version"  # written in another value-format version
    FOREIGN = "foreign"  # written by another model, dtype or block layout
    MISMATCH = "mismatch"  # its block hash, parent hash or token ids differ from the request's
    EVICTED = "evicted"  # present at lookup, gone by the fetch


class StoreUnavailable(Exception):
    """A backend operation failed; `kind` is CONNECTION, TIMEOUT, SERVER or FULL."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ValueRejected(Exception):
    """A stored value is not the block expected; `kind` says why."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
