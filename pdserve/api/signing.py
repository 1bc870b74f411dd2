"""Fleet request signatures: how a deployment's router proves membership to its workers over
HTTP without sending the fleet secret.

Every request the router sends a worker (legs, health checks, scrapes, /tokenize, role and
drain calls) carries::

    Authorization: Fleet t=<unix time>, n=<nonce>, s=<HMAC-SHA256 hex>

where the MAC, under a key derived from the fleet secret (never the secret itself, so an
HTTP signature is never a KV proof), covers the method, the Host the request was sent to, the
path with its query, the timestamp, the nonce and the SHA-256 of the body (`canonical`). The
worker (`FleetSignatureMiddleware` in `api.asgi`) accepts a signature only within
`MAX_CLOCK_SKEW_S` of its own clock and each nonce once (`ReplayGuard`), so a captured request
can neither be replayed nor re-aimed at another worker, path or body.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass

import httpx

SCHEME = "Fleet"
# How far a signature's timestamp may be from the worker's clock (cluster nodes keep NTP time).
MAX_CLOCK_SKEW_S = 30.0
# Nonces a worker remembers at most; far above any worker's request rate within the window.
REPLAY_CACHE_SIZE = 1 << 16
_NONCE_BYTES = 16


def signing_key(secret: str) -> bytes:
    """The HTTP signing key: the fleet secret under its own label (domain separation)."""
    return hmac.new(secret.encode(), b"pdserve fleet http signature", hashlib.sha256).digest()


def canonical(
    method: str, host: str, target: str, timestamp: str, nonce: str, body: bytes
) -> bytes:
    """What a signature covers; `target` is the path with ``?query`` when there is one."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((method.upper(), host, target, timestamp, nonce, digest)).encode()


def signature(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class FleetAuth(httpx.Auth):
    """Signs every request of the httpx client it is given to (``auth=``)."""

    requires_request_body = True

    def __init__(self, secret: str) -> None:
        self._key = signing_key(secret)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        timestamp = f"{time.time():.3f}"
        nonce = secrets.token_hex(_NONCE_BYTES)
        message = canonical(
            request.method,
            request.headers["Host"],
            request.url.raw_path.decode("ascii"),
            timestamp,
            nonce,
            request.content,
        )
        request.headers["Authorization"] = (
            f"{SCHEME} t={timestamp}, n={nonce}, s={signature(self._key, message)}"
        )
        yield request


@dataclass(frozen=True)
class SignedHeader:
    timestamp: str
    nonce: str
    signature: str

    @property
    def unix_time(self) -> float:
        return float(self.timestamp)


def parse_header(value: bytes) -> SignedHeader | None:
    """The fields of an ``Authorization: Fleet ...`` header; None if it is not one."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    scheme, _, rest = text.partition(" ")
    if scheme.lower() != SCHEME.lower():
        return None
    fields = dict(part.strip().partition("=")[::2] for part in rest.split(","))
    timestamp, nonce, mac = fields.get("t", ""), fields.get("n", ""), fields.get("s", "")
    try:
        if not math.isfinite(float(timestamp)):
            return None
    except ValueError:
        return None
    if not (0 < len(nonce) <= 64 and nonce.isalnum() and len(mac) == 64):
        return None
    return SignedHeader(timestamp, nonce, mac)


class ReplayGuard:
    """The nonces of the signed requests accepted within the skew window: each is admitted
    once. Memory is bounded: past `capacity` the oldest admitted nonce is forgotten and the
    guard's floor rises to its timestamp, so no request signed at or before the floor is
    admitted again (a replay of a forgotten nonce is refused; honest requests are newer)."""

    def __init__(self, window_s: float = MAX_CLOCK_SKEW_S, capacity: int = REPLAY_CACHE_SIZE):
        self.window_s = window_s
        self._capacity = capacity
        # nonce -> its request's timestamp, in the order admitted.
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._floor = -math.inf

    def __len__(self) -> int:
        return len(self._seen)

    def is_in_window(self, timestamp: float, now: float) -> bool:
        """Whether a request signed at `timestamp` may be admitted at all (checked before its
        body is read)."""
        return abs(now - timestamp) <= self.window_s and timestamp > self._floor

    def admit(self, nonce: str, timestamp: float, now: float) -> bool:
        """Whether a request with a verified signature is fresh (and remember it if so)."""
        if not self.is_in_window(timestamp, now) or nonce in self._seen:
            return False
        # A nonce whose timestamp left the window is refused by the clock check already.
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)
        self._seen[nonce] = timestamp
        while len(self._seen) > self._capacity:
            _, forgotten = self._seen.popitem(last=False)
            self._floor = max(self._floor, forgotten)
        return True
