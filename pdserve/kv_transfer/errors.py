"""Errors raised by the KV-transfer data plane.

Every error a caller can see is a `KVTransferError`; the subclasses say what went wrong so the
connector can choose between recomputing, failing the request, or reporting a bad deployment.
"""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A KV transfer could not be completed."""


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
