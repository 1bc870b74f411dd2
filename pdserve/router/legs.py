"""The two legs' request bodies (docs/architecture.md, "the HTTP-level hand-off")."""

from __future__ import annotations

from typing import Any

# Fields only the router may set on a leg; a client's own copies are dropped.
ROUTER_OWNED_FIELDS = ("kv_transfer_params", "router_timing")
# Dropped from the prefill leg: it generates exactly one token and answers in one body.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens")


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as a prefill leg: one token, no stream, KV kept for a decoder."""
    leg = {
        k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL and k not in ROUTER_OWNED_FIELDS
    }
    leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return leg


def decode_leg_body(
    body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    router_timing: dict[str, float],
    *,
    force_usage: bool,
) -> dict[str, Any]:
    """The client's request plus the prefill worker's `kv_transfer_params` (None: the decode
    worker prefills locally) and the router's timing. `force_usage` asks a stream for its
    final usage chunk, where the worker reports its timing."""
    leg = {k: v for k, v in body.items() if k not in ROUTER_OWNED_FIELDS}
    if kv_transfer_params is not None:
        leg["kv_transfer_params"] = kv_transfer_params
    leg["router_timing"] = router_timing
    if force_usage and leg.get("stream"):
        options = leg.get("stream_options")
        leg["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    return leg


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether the client itself asked a stream for the final usage chunk."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
