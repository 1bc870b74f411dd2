"""Membership of a deployment: the fleet secret that lets only its own processes in.

The launcher makes one secret per deployment (or takes the operator's, from
``$PDSERVE_FLEET_SECRET``) and hands it to each worker in that environment variable, never in
argv (which every user of the host can read). A worker takes it out of its environment at start
(`take_fleet_secret`), so nothing it starts inherits it; then
- its HTTP API answers only requests signed with it (`api.signing`: an HMAC over the request
  with a timestamp and a nonce, never the secret), except ``GET /health`` (up or down,
  nothing more: probes need no secret);
- its KV server admits only peers that prove they hold it, and its KV connections prove it,
  by an HMAC challenge-response (`kv_transfer.wire`): the secret itself never crosses the wire.
The router signs every leg (prefill, decode, health checks, scrapes, /tokenize, role and drain
calls) and proves it when it releases a KV lease nobody claimed.
"""

from __future__ import annotations

import os
import secrets

FLEET_SECRET_ENV = "PDSERVE_FLEET_SECRET"


def deployment_secret() -> str:
    """The operator's secret from the environment, else a new random one (256 bits)."""
    return os.environ.get(FLEET_SECRET_ENV) or secrets.token_urlsafe(32)


def take_fleet_secret() -> str | None:
    """This process's fleet secret, removed from its environment (None: not a member of a
    guarded deployment)."""
    return os.environ.pop(FLEET_SECRET_ENV, None) or None


def fleet_secret_from_env() -> str | None:
    """The fleet secret a router started by hand presents (left in place)."""
    return os.environ.get(FLEET_SECRET_ENV) or None
