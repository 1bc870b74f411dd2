"""Per-request timing on the event loop: feeds the metrics and writes one log line per request.

Token times are taken when an output reaches the event loop, i.e. what the HTTP layer sees;
queue and prefill times come from the engine's own clocks (same `time.monotonic` base, since
the server passes its arrival time to the engine).
"""

from __future__ import annotations

import logging
import time

from pdserve.core.request import FinishReason
from pdserve.engine.outputs import RequestOutput
from pdserve.server.metrics import ServerMetrics

access_logger = logging.getLogger("pdserve.server.access")


class RequestTracker:
    """Observes one request's outputs; `finish()` records its metrics and log line once."""

    def __init__(
        self, request_id: str, endpoint: str, metrics: ServerMetrics, arrival_time: float
    ) -> None:
        self.request_id = request_id
        self._endpoint = endpoint
        self._metrics = metrics
        self.arrival_time = arrival_time
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._final: RequestOutput | None = None
        self._num_prompt_tokens = 0
        self._num_output_tokens = 0
        self._is_done = False

    def observe(self, output: RequestOutput) -> None:
        """Call for every output as it arrives on the event loop."""
        num_new = len(output.new_token_ids)
        self._num_prompt_tokens = output.num_prompt_tokens
        self._num_output_tokens = output.num_output_tokens
        if num_new:
            now = time.monotonic()
            if self._first_token_time is None:
                self._first_token_time = now
                self._metrics.prompt_tokens.inc(output.num_prompt_tokens)
                self._metrics.time_to_first_token.observe(now - self.arrival_time)
            else:
                gap = (now - self._last_token_time) / num_new
                for _ in range(num_new):
                    self._metrics.inter_token_latency.observe(gap)
            self._last_token_time = now
            self._metrics.generation_tokens.inc(num_new)
        if output.finished:
            self._final = output

    def finish(self, status: str = "ok") -> None:
        """Record the request (idempotent). `status` is "ok", "error" (the engine failed it)
        or "client_disconnected" (aborted before its final output was read)."""
        if self._is_done:
            return
        self._is_done = True
        now = time.monotonic()
        final = self._final
        if final is not None:
            self._record_finished(final, now)
            reason = final.finish_reason.value if final.finish_reason else "none"
        elif status == "client_disconnected":
            reason = FinishReason.ABORT.value
            self._metrics.count_success(reason)
        else:
            reason = "none"
        ttft = (
            self._first_token_time - self.arrival_time
            if self._first_token_time is not None
            else None
        )
        access_logger.info(
            "%s %s status=%s finish=%s prompt_tokens=%d output_tokens=%d cached_tokens=%s "
            "ttft_ms=%s e2e_ms=%.1f",
            self.request_id,
            self._endpoint,
            status,
            reason,
            self._num_prompt_tokens,
            self._num_output_tokens,
            final.num_cached_tokens if final else "-",
            f"{ttft * 1e3:.1f}" if ttft is not None else "-",
            (now - self.arrival_time) * 1e3,
        )

    def _record_finished(self, final: RequestOutput, now: float) -> None:
        metrics = self._metrics
        reason = final.finish_reason.value if final.finish_reason else "none"
        metrics.count_success(reason)
        metrics.e2e_latency.observe(now - self.arrival_time)
        metrics.prompt_tokens_per_request.observe(final.num_prompt_tokens)
        metrics.generation_tokens_per_request.observe(final.num_output_tokens)
        engine_clock = final.metrics
        if engine_clock.first_scheduled_time is not None:
            metrics.queue_time.observe(engine_clock.first_scheduled_time - self.arrival_time)
        if engine_clock.prefill_time:
            metrics.prefill_time.observe(engine_clock.prefill_time)
        transfer = final.kv_transfer
        if transfer is not None and transfer.exposed_seconds is not None:
            metrics.kv_transfer_exposed.observe(transfer.exposed_seconds)
            metrics.kv_transfer_hidden.observe(transfer.seconds - transfer.exposed_seconds)
        if transfer is not None and transfer.num_kept_tokens:
            metrics.kv_stream_kept_tokens.inc(transfer.num_kept_tokens)
        first, last = self._first_token_time, self._last_token_time
        if first is not None and last is not None:
            metrics.decode_time.observe(last - first)
            if final.num_output_tokens > 1:
                metrics.time_per_output_token.observe(
                    (last - first) / (final.num_output_tokens - 1)
                )
