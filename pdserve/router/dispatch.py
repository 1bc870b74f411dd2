"""One client request through the router: route, prefill leg, decode leg, relay.

1. Tokenize (when routing needs ids), pick a decode worker, and decide: a prompt whose
   uncached length on that worker is below --local-prefill-threshold goes to it directly.
2. Otherwise the prefill leg goes to a prefill worker; a connection error, 429 or 5xx (or an
   answer without ``kv_transfer_params``) is retried once on another prefill worker, then the
   decode worker prefills locally. A 4xx is the client's fault and is relayed as is.
3. The decode leg (original body + ``kv_transfer_params`` + ``router_timing``) is relayed:
   SSE untouched for streams, the body plus an ``x-pdserve-timing`` header otherwise. A decode
   worker unreachable before answering is replaced once; one that breaks mid-stream ends the
   client's stream with an error event. KV the decode leg never took (refused, unreachable,
   client gone) is released on the prefill worker at once (`handoff.UnclaimedKV`).

With ``--kv-handoff stream`` the prefill leg is an SSE stream whose first event announces
where its KV will appear; the decode leg starts on that announcement, while the prefill worker
still computes (the decode worker receives chunk by chunk), and the rest of the prefill leg
drains in the background. A flight that ends first closes it, which aborts it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import httpx
from starlette.requests import Request
from starlette.responses import Response

from pdserve.api.asgi import (
    CLIENT_CLOSED_STATUS,
    ClientDisconnected,
    ManagedStreamingResponse,
    until_disconnected,
)
from pdserve.api.errors import APIError, ErrorType
from pdserve.router.config import KVHandoff, RouterConfig
from pdserve.router.handoff import UnclaimedKV, decode_leg_body, prefill_leg_body, wants_usage
from pdserve.router.health import HealthMonitor
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Lease, Worker, WorkerRegistry
from pdserve.router.prefix_index import PromptInfo
from pdserve.router.relay import relay_events
from pdserve.router.timing import (
    TIMING_HEADER,
    RequestTiming,
    Route,
    extract_worker_timing,
    now_ms,
)
from pdserve.router.tokenizer import PromptTokenizer, literal_token_ids

logger = logging.getLogger("pdserve.router")

PREFILL_ATTEMPTS = 2
DECODE_ATTEMPTS = 2
# Headers of a worker's answer kept when the router relays it.
_RELAYED_HEADERS = ("retry-after",)


class _UpstreamAnswer(Exception):
    """A worker's answer that goes to the client as is (e.g. a 400 naming a bad field)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass
class _Flight:
    """One request's routing state; `decode` is the lease on its current decode worker."""

    endpoint: str
    body: dict[str, Any]
    prompt: PromptInfo
    timing: RequestTiming
    decode: Lease | None = None
    is_finished: bool = False
    # A streamed prefill leg's answer, still draining after its hand-off was announced.
    prefill_drain: asyncio.Task | None = None


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        health: HealthMonitor,
        metrics: RouterMetrics,
        tokenizer: PromptTokenizer,
    ) -> None:
        self.config = config
        self.registry = registry
        self.client = client
        self.health = health
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.unclaimed_kv = UnclaimedKV(
            config.connect_timeout_s, config.fleet_secret, config.fleet_tls
        )

    async def handle(self, request: Request, endpoint: str, body: dict[str, Any]) -> Response:
        """Serve `endpoint` (``/v1/completions`` or ``/v1/chat/completions``) for `body`, the
        client's JSON object (validated already by its `pdserve.api.protocol` model)."""
        timing = RequestTiming(f"rtr-{uuid.uuid4().hex[:16]}")
        flight: _Flight | None = None
        if body.get("stream") is None:
            body.pop("stream", None)
        try:
            flight = _Flight(endpoint, body, await self._prompt_info(endpoint, body), timing)
            return await self._dispatch(request, flight)
        except APIError as exc:
            response = exc.response()
        except _UpstreamAnswer as answer:
            response = answer.response
        except ClientDisconnected:
            self.metrics.count_error("client_disconnected")
            response = Response(status_code=CLIENT_CLOSED_STATUS)
        except BaseException:
            if flight is not None:
                self._finish(flight)
            raise
        if flight is not None:
            self._finish(flight)
        response.headers["x-request-id"] = timing.request_id
        return response

    async def _prompt_info(self, endpoint: str, body: dict[str, Any]) -> PromptInfo:
        if not self.config.needs_token_ids:
            return PromptInfo.estimate(body)
        token_ids = literal_token_ids(body) or await self.tokenizer.token_ids(endpoint, body)
        if token_ids is None:
            return PromptInfo.estimate(body)
        return PromptInfo.from_token_ids(token_ids, self.config.block_size)

    async def _dispatch(self, request: Request, flight: _Flight) -> Response:
        selection = self.registry.decode.select(flight.prompt)
        if selection is None:
            raise self._fail("no_worker", ErrorType.UNAVAILABLE, "no healthy decode worker")
        flight.decode = self.registry.decode.acquire(selection.worker)
        flight.timing.mark_dispatched()
        kv_params = await self._kv_params(request, flight, selection.num_cached_tokens)
        try:
            upstream = await self._open_decode(request, flight, kv_params)
        except BaseException:
            self.unclaimed_kv.release(kv_params)
            raise
        if upstream.status_code != 200:
            self.unclaimed_kv.release(kv_params)
            await self._relay_failure(request, flight, upstream)
        if flight.body.get("stream"):
            return self._stream(flight, upstream)
        return await self._complete(request, flight, upstream)

    # ---- prefill leg -------------------------------------------------------------------
    async def _kv_params(
        self, request: Request, flight: _Flight, num_cached_tokens: int
    ) -> dict[str, Any] | None:
        """The prefill worker's ``kv_transfer_params``, or None when decode prefills."""
        num_uncached = flight.prompt.num_tokens - num_cached_tokens
        if not self.registry.prefill.is_staffed or (
            num_uncached < self.config.local_prefill_threshold
        ):
            flight.timing.route = Route.LOCAL
            flight.timing.predicted_hit_tokens = num_cached_tokens
            return None
        params = await until_disconnected(request, self._prefill(flight))
        if params is None:
            self.metrics.count_error("prefill_failed")
            flight.timing.route = Route.LOCAL_FALLBACK
            flight.timing.predicted_hit_tokens = num_cached_tokens
        else:
            flight.timing.route = Route.REMOTE
        return params

    async def _prefill(self, flight: _Flight) -> dict[str, Any] | None:
        started = now_ms()
        leg = prefill_leg_body(flight.body, is_streamed=self.config.kv_handoff is KVHandoff.STREAM)
        tried: list[str] = []
        try:
            for attempt in range(PREFILL_ATTEMPTS):
                selection = self.registry.prefill.select(flight.prompt, exclude=tried)
                if selection is None:
                    return None
                if attempt:
                    self.metrics.prefill_retries.inc()
                worker = selection.worker
                tried.append(worker.worker_id)
                flight.timing.num_prefill_attempts += 1
                flight.timing.predicted_hit_tokens = selection.num_cached_tokens
                params = await self._prefill_once(worker, flight, leg)
                if params is not None:
                    flight.timing.prefill_worker = worker.worker_id
                    return params
            return None
        finally:
            flight.timing.prefill_ms = now_ms() - started

    async def _prefill_once(
        self, worker: Worker, flight: _Flight, leg: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The KV params of one attempt; None when it failed in a way worth retrying."""
        lease = self.registry.prefill.acquire(worker, flight.prompt.num_tokens)
        if leg["stream"]:
            return await self._prefill_streamed(worker, flight, leg, lease)
        try:
            response = await self.client.post(
                f"{worker.url}{flight.endpoint}", json=leg, headers=self._leg_headers(flight)
            )
        except httpx.TransportError as exc:
            self.health.report_failure(worker, f"prefill leg: {_describe(exc)}")
            return None
        finally:
            lease.release()
        if not _is_prefill_answer(worker, response):
            return None
        answer = _json(response.content)
        params = _object_field(answer, "kv_transfer_params")
        flight.timing.hit_tokens = _cached_tokens(answer)
        if params is None:
            logger.warning(
                "prefill worker %s answered without kv_transfer_params", worker.worker_id
            )
        return params

    async def _prefill_streamed(
        self, worker: Worker, flight: _Flight, leg: dict[str, Any], lease: Lease
    ) -> dict[str, Any] | None:
        """Open a streamed prefill leg; return the hand-off its first event announces, and
        leave the rest of the answer draining (holding the pool lease) on the flight."""
        request = self.client.build_request(
            "POST", f"{worker.url}{flight.endpoint}", json=leg, headers=self._leg_headers(flight)
        )
        response: httpx.Response | None = None
        params = None
        try:
            response = await self.client.send(request, stream=True)
            if response.status_code != 200:
                await response.aread()
            if _is_prefill_answer(worker, response):  # raises to relay a 4xx
                lines = response.aiter_lines()
                params = await _announced_hand_off(lines)
                if params is None:
                    logger.warning("prefill worker %s announced no hand-off", worker.worker_id)
        except httpx.TransportError as exc:
            self.health.report_failure(worker, f"prefill leg: {_describe(exc)}")
        finally:
            if params is None:  # also on a relayed answer or cancellation
                if response is not None:
                    await response.aclose()
                lease.release()
        if params is None:
            return None
        flight.prefill_drain = asyncio.create_task(_drain(response, lines, lease))
        return params

    # ---- decode leg --------------------------------------------------------------------
    async def _open_decode(
        self, request: Request, flight: _Flight, kv_params: dict[str, Any] | None
    ) -> httpx.Response:
        """Send the decode leg and return its response, headers read, body still streaming."""
        leg = decode_leg_body(
            flight.body, kv_params, flight.timing.router_timing_field(), force_usage=True
        )
        tried: list[str] = []
        for _ in range(DECODE_ATTEMPTS):
            worker = flight.decode.worker
            tried.append(worker.worker_id)
            flight.timing.decode_worker = worker.worker_id
            try:
                return await until_disconnected(request, self._send(worker, flight, leg))
            except httpx.TransportError as exc:
                self.health.report_failure(worker, f"decode leg: {_describe(exc)}")
            flight.decode.release()
            selection = self.registry.decode.select(flight.prompt, exclude=tried)
            if selection is None:
                break
            flight.decode = self.registry.decode.acquire(selection.worker)
        raise self._fail(
            "decode_failed", ErrorType.BAD_GATEWAY, "no decode worker could take the request"
        )

    async def _send(self, worker: Worker, flight: _Flight, leg: dict[str, Any]) -> httpx.Response:
        upstream = self.client.build_request(
            "POST", f"{worker.url}{flight.endpoint}", json=leg, headers=self._leg_headers(flight)
        )
        return await self.client.send(upstream, stream=True)

    async def _relay_failure(
        self, request: Request, flight: _Flight, upstream: httpx.Response
    ) -> NoReturn:
        """The decode worker refused the leg: its answer goes to the client as is."""
        content = await self._read(request, flight, upstream)
        if upstream.status_code >= 500:
            self.metrics.count_error("decode_failed")
        raise _UpstreamAnswer(_relayed(upstream, content))

    def _stream(self, flight: _Flight, upstream: httpx.Response) -> Response:
        events = relay_events(
            upstream,
            flight.timing,
            strip_usage=not wants_usage(flight.body),
            on_broken=partial(self._on_stream_broken, flight),
        )

        async def on_close() -> None:
            await upstream.aclose()
            self._finish(flight)

        return ManagedStreamingResponse(
            events, on_close, media_type="text/event-stream", headers=self._client_headers(flight)
        )

    async def _complete(
        self, request: Request, flight: _Flight, upstream: httpx.Response
    ) -> Response:
        content = await self._read(request, flight, upstream)
        flight.timing.mark_first_byte()
        flight.timing.take_worker_report(extract_worker_timing(_json(content)) or {})
        self._finish(flight)
        return _relayed(upstream, content, self._client_headers(flight))

    async def _read(self, request: Request, flight: _Flight, upstream: httpx.Response) -> bytes:
        try:
            return await until_disconnected(request, upstream.aread())
        except httpx.TransportError as exc:
            self.health.report_failure(flight.decode.worker, f"decode leg: {_describe(exc)}")
            raise self._fail(
                "decode_failed",
                ErrorType.BAD_GATEWAY,
                f"decode worker failed mid-response: {_describe(exc)}",
            ) from exc
        finally:
            await upstream.aclose()

    # ---- bookkeeping -------------------------------------------------------------------
    def _on_stream_broken(self, flight: _Flight, reason: str, is_transport_error: bool) -> None:
        self.metrics.count_error("decode_stream_broken")
        logger.warning("request %s: %s", flight.timing.request_id, reason)
        if is_transport_error:
            self.health.report_failure(flight.decode.worker, reason)

    def _finish(self, flight: _Flight) -> None:
        if flight.is_finished:
            return
        flight.is_finished = True
        if flight.prefill_drain is not None:
            flight.prefill_drain.cancel()  # a no-op once it answered; else aborts it there
        if flight.decode is not None:
            flight.decode.release()
        flight.timing.mark_done()
        self.metrics.observe(flight.timing)
        if logger.isEnabledFor(logging.INFO):
            logger.info("request %s", flight.timing.header_value())

    def _fail(self, code: str, error_type: ErrorType, message: str) -> APIError:
        """The router's own failure `code` (counted by that name), as an OpenAI error."""
        self.metrics.count_error(code)
        return APIError(error_type, message, code=code)

    @staticmethod
    def _leg_headers(flight: _Flight) -> dict[str, str]:
        return {"x-request-id": flight.timing.request_id}

    @staticmethod
    def _client_headers(flight: _Flight) -> dict[str, str]:
        return {
            TIMING_HEADER: flight.timing.header_value(),
            "x-request-id": flight.timing.request_id,
        }


def _is_prefill_answer(worker: Worker, response: httpx.Response) -> bool:
    """A 200 is an answer; 429 and 5xx are worth a retry elsewhere (False); another 4xx is
    the client's fault, relayed as is. `response`'s body is read already."""
    if response.status_code == 429 or response.status_code >= 500:
        logger.warning(
            "prefill worker %s answered %d; retrying elsewhere",
            worker.worker_id,
            response.status_code,
        )
        return False
    if response.status_code != 200:
        raise _UpstreamAnswer(_relayed(response, response.content))
    return True


async def _announced_hand_off(lines: AsyncIterator[str]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a streamed prefill leg's first events (None: the stream
    ended, or failed, without one)."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return None
        event = _json(data.encode())
        params = _object_field(event, "kv_transfer_params")
        if params is not None:
            return params
        if _object_field(event, "error") is not None:
            return None
    return None


async def _drain(response: httpx.Response, lines: AsyncIterator[str], lease: Lease) -> None:
    """Read a streamed prefill leg to its end (its worker finishes the request), then free
    the prefill pool's lease. Cancelled: the connection closes, which aborts it there."""
    try:
        async for _ in lines:
            pass
    except httpx.HTTPError as exc:
        # The decode worker keeps what arrived and computes the rest: only worth a log line.
        logger.warning("streamed prefill leg broke off: %s", _describe(exc))
    finally:
        with contextlib.suppress(httpx.HTTPError):
            await response.aclose()
        lease.release()


def _relayed(
    upstream: httpx.Response, content: bytes, headers: dict[str, str] | None = None
) -> Response:
    kept = {k: upstream.headers[k] for k in _RELAYED_HEADERS if k in upstream.headers}
    return Response(
        content,
        status_code=upstream.status_code,
        headers={**kept, **(headers or {})},
        media_type=upstream.headers.get("content-type"),
    )


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


def _object_field(body: Any, key: str) -> dict[str, Any] | None:
    """``body[key]`` when the body is a JSON object and that field is an object."""
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, dict) else None


def _cached_tokens(body: Any) -> int:
    """The answer's ``usage.prompt_tokens_details.cached_tokens`` (absent: none)."""
    details = _object_field(_object_field(body, "usage"), "prompt_tokens_details")
    cached = details.get("cached_tokens") if details else 0
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else 0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
