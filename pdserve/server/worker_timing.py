"""`pdserve_timing`: where a routed request's time went on this worker, for the router.

A request carrying ``router_timing`` (the router's own measurements in ms, see
`pdserve.router.timing`) gets it echoed back with this worker's numbers added, in the final
usage chunk of a stream or the body of a plain response:

=======================  =================================================================
(router_timing entries)  echoed as given (numbers only)
kv_transfer_bytes        KV bytes this worker fetched from a prefill worker (0: none)
kv_transfer_ms           how long that fetch took
kv_transfer_exposed_ms   the part of it after the prefill worker's last step (on the TTFT's
                         critical path; all of it when pulled after prefill)
kv_transfer_hidden_ms    the part while the prefill worker still computed (streamed)
kv_transfer_error        only when the fetch failed (the prompt was recomputed here)
kv_kept_tokens           only when a stream broke off: prompt tokens kept from it
kv_store_hit_tokens      prompt tokens read from the shared KV store (0: none)
kv_store_fetch_ms        how long reading them took
prefix_cache_hit_tokens  prompt tokens found in this worker's own prefix cache
first_decode_step_ms     the engine emitting the first token to the second token reaching
                         the HTTP layer: the first decode step (a remote prefill's first
                         token leaves as its KV lands, before that step)
worker_queue_ms          arrival here to the request's first scheduled step
worker_prefill_ms        forward-pass time this worker spent on the prompt
worker_ttft_ms           arrival here to the first token
=======================  =================================================================
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.engine.outputs import RequestOutput

# Bounds what a client can make the server echo.
MAX_ECHOED_ENTRIES = 16


class WorkerTiming:
    """Observes one request's outputs on the event loop; `report()` renders the field.

    Times are `time.monotonic()`, the engine's clock too (`RequestMetrics`)."""

    def __init__(self, router_timing: dict[str, Any]) -> None:
        self._echoed = _numbers(router_timing)
        self._first_token_time: float | None = None
        self._second_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        if not output.new_token_ids or self._second_token_time is not None:
            return
        now = time.monotonic()
        if self._first_token_time is None:
            self._first_token_time = now
        else:
            self._second_token_time = now

    def report(self, final: RequestOutput) -> dict[str, Any]:
        clock = final.metrics
        report: dict[str, Any] = dict(self._echoed)
        transfer = final.kv_transfer
        report["kv_transfer_bytes"] = transfer.num_bytes if transfer is not None else 0
        report["kv_transfer_ms"] = _ms(transfer.seconds) if transfer is not None else 0.0
        if transfer is not None and transfer.exposed_seconds is not None:
            report["kv_transfer_exposed_ms"] = _ms(transfer.exposed_seconds)
            report["kv_transfer_hidden_ms"] = _ms(transfer.seconds - transfer.exposed_seconds)
        if transfer is not None and transfer.error is not None:
            report["kv_transfer_error"] = transfer.error
        if transfer is not None and transfer.num_kept_tokens:
            report["kv_kept_tokens"] = transfer.num_kept_tokens
        store = final.kv_store
        report["kv_store_hit_tokens"] = store.num_hit_tokens if store is not None else 0
        report["kv_store_fetch_ms"] = _ms(store.seconds) if store is not None else 0.0
        report["prefix_cache_hit_tokens"] = final.num_cached_tokens - report["kv_store_hit_tokens"]
        if self._first_token_time is not None:
            report["worker_ttft_ms"] = _ms(self._first_token_time - clock.arrival_time)
        if self._second_token_time is not None and clock.first_token_time is not None:
            report["first_decode_step_ms"] = _ms(self._second_token_time - clock.first_token_time)
        if clock.first_scheduled_time is not None:
            report["worker_queue_ms"] = _ms(clock.first_scheduled_time - clock.arrival_time)
        report["worker_prefill_ms"] = _ms(clock.prefill_time)
        return report


def _numbers(given: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of an untrusted dict, at most `MAX_ECHOED_ENTRIES`."""
    numbers = {
        k: v
        for k, v in given.items()
        if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
    }
    return dict(list(numbers.items())[:MAX_ECHOED_ENTRIES])


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
