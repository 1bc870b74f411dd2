"""Runs a synchronous `LLMEngine` on its own thread and streams its outputs to asyncio.

Threading model: the engine thread is the only one that touches the `LLMEngine`. The event
loop hands it new requests and aborts through lock-protected inboxes, which the thread applies
between steps; the thread hands results back with one `loop.call_soon_threadsafe` per step,
which feeds each request's `asyncio.Queue`. So a long forward pass never blocks HTTP handling,
and an abort (client disconnect) takes effect before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.core.config import DEFAULT_BURST_GAP_S, MAX_BURST_GAPS
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.core.scheduler import EngineStats, Scheduler
from pdserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

# The idle engine thread wakes this often just to refresh its heartbeat.
HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_MAX_QUEUE = 256
DEFAULT_HEALTH_TIMEOUT_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request can be served."""


class EngineOverloadedError(RuntimeError):
    """Admission control: the waiting queue is full. Retry after `retry_after_s`."""

    def __init__(self, num_waiting: int, max_queue: int, retry_after_s: int) -> None:
        super().__init__(
            f"server is overloaded: {num_waiting} requests waiting "
            f"(max_queue={max_queue}); retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """The engine raised while running this request; the request is gone, the server is not."""


class EngineProtocol(Protocol):
    """What the async wrapper needs from `LLMEngine` (see docs/architecture.md)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
        arrival_time: float | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def measure_when_idle(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...

    @property
    def scheduler(self) -> Scheduler: ...


@dataclass
class _IdleCall:
    """A function to run on the engine thread once nothing is in flight."""

    fn: Callable[[EngineProtocol], Any]
    future: asyncio.Future
    queued_at: float
    deadline: float


@dataclass
class _Submission:
    stream: RequestStream
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict | None
    arrival_time: float


class _Accepted:
    """First item of a stream's queue once the engine thread has admitted the request."""


_ACCEPTED = _Accepted()
# What the engine thread pushes into a stream: an output, the admission marker or an error.
_StreamItem = RequestOutput | _Accepted | BaseException


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Ends after the output with `finished=True`; raises `RequestFailedError` or
    `EngineDeadError` if the engine failed the request. `close()` aborts an unfinished request.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self.is_finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        assert isinstance(item, RequestOutput)
        self.is_finished = item.finished
        return item

    async def _wait_accepted(self) -> None:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.is_finished:
            self.is_finished = True
            self._engine.abort(self.request_id)
        self._engine._forget(self.request_id)

    def _put(self, item: _StreamItem) -> None:
        self._queue.put_nowait(item)


class AsyncLLMEngine:
    """Serves an `LLMEngine` to asyncio code: `add_request()`/`generate()`, `abort()`, stats.

    `max_queue` bounds the requests waiting for their first step (admission control).
    `burst_gap_s` is how long an idle engine waits for a burst's next request (0: it starts
    at once; see `_gather_burst`).
    """

    def __init__(
        self,
        engine: EngineProtocol,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        burst_gap_s: float = DEFAULT_BURST_GAP_S,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        if burst_gap_s < 0:
            raise ValueError(f"burst_gap_s must be >= 0, got {burst_gap_s}")
        self.engine = engine
        self.max_queue = max_queue
        self.burst_gap_s = burst_gap_s
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._new: list[_Submission] = []
        self._aborts: list[str] = []
        self._stats = EngineStats(heartbeat=time.monotonic())
        self._num_engine_waiting = 0  # as of the latest snapshot; guarded by _lock
        self._shutdown_deadline: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Loop side: ids with a live stream (rejects duplicates). Engine side: admitted streams.
        self._active_ids: set[str] = set()
        self._running: dict[str, RequestStream] = {}
        # Guarded by _lock; while set, new requests wait in `_new` (admitted after it ran).
        self._idle_call: _IdleCall | None = None

    # ---- lifecycle (event loop) ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that will consume."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admitting; in-flight requests get `grace_s` seconds to finish, then are aborted
        with a final `finish_reason=abort` output. Thread-safe and idempotent."""
        with self._lock:
            deadline = time.monotonic() + max(grace_s, 0.0)
            if self._shutdown_deadline is None or deadline < self._shutdown_deadline:
                self._shutdown_deadline = deadline
        self._wakeup.set()

    async def shutdown(self, grace_s: float = 0.0, timeout_s: float = 30.0) -> None:
        """`begin_shutdown` and wait for the engine thread to exit."""
        self.begin_shutdown(grace_s)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, grace_s + timeout_s)

    # ---- requests (event loop) -------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request; return its stream once the engine thread has admitted it.

        `arrival_time` (time.monotonic(), default now) is when the request reached the server;
        the engine's per-request clocks start there.

        Raises `EngineOverloadedError` (queue full), `EngineDeadError`, `ValueError` (duplicate
        id) or, from the engine's own checks, `InvalidParameterError`. Admission happens at the
        start of the next step, so waiting for it costs no latency the request would not pay.
        """
        self._check_alive()
        if request_id in self._active_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(self, request_id)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        with self._lock:
            if self._shutdown_deadline is not None:
                raise EngineDeadError("server is shutting down")
            num_waiting = self._num_engine_waiting + len(self._new)
            if num_waiting >= self.max_queue:
                raise EngineOverloadedError(num_waiting, self.max_queue, self._retry_after_s())
            self._new.append(
                _Submission(
                    stream,
                    list(prompt_token_ids),
                    sampling_params,
                    kv_transfer_params,
                    arrival_time,
                )
            )
        self._active_ids.add(request_id)
        self._wakeup.set()
        try:
            await stream._wait_accepted()
        except BaseException:
            # Rejected, or the caller went away (e.g. cancelled) before admission.
            stream.close()
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; closing or cancelling the iterator aborts it."""
        stream = await self.add_request(
            request_id, prompt_token_ids, sampling_params, kv_transfer_params
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def run_when_idle(
        self, fn: Callable[[EngineProtocol], Any], timeout_s: float
    ) -> tuple[Any, float]:
        """Run `fn(engine)` on the engine thread as soon as it has nothing in flight (no
        request, no KV held or moving); requests arriving meanwhile are admitted after it.
        Returns `fn`'s result and the seconds spent waiting for the engine to empty.

        Raises `TimeoutError` when the engine is still busy after `timeout_s` (nothing ran),
        `RuntimeError` while another such call waits, or what `fn` raised."""
        self._check_alive()
        now = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._idle_call is not None:
                raise RuntimeError("another engine change is waiting for the engine to empty")
            self._idle_call = _IdleCall(fn, future, now, now + timeout_s)
        self._wakeup.set()
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); it leaves the engine before the next step."""
        with self._lock:
            self._aborts.append(request_id)
        self._wakeup.set()

    def _forget(self, request_id: str) -> None:
        self._active_ids.discard(request_id)

    # ---- health and stats (any thread) -----------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The engine's latest snapshot; `num_waiting` includes requests not yet admitted."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def is_healthy(self, timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S) -> bool:
        """True while the engine thread is alive and its loop made progress within
        `timeout_s` (an idle loop still beats every `HEARTBEAT_INTERVAL_S`)."""
        return (
            self.is_running
            and self._shutdown_deadline is None
            and time.monotonic() - self._stats.heartbeat < timeout_s
        )

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if not self.is_running:
            raise EngineDeadError("engine loop is not running")

    def _retry_after_s(self) -> int:
        # A rough time for the queue to move: a few steps, at least one second.
        return max(1, round((self._stats.last_step_time or 0.0) * 4))

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        outbox: list[tuple[RequestStream, _StreamItem]] = []
        try:
            while True:
                self._gather_burst()
                self._wakeup.clear()
                self._apply_inbox(outbox)
                if self._shutdown_due():
                    self._abort_all(outbox)
                    break
                self._run_idle_call()
                if self.engine.has_unfinished_requests():
                    self._step(outbox)
                elif not self.engine.measure_when_idle():  # one piece, then new requests
                    self._publish_stats()
                    self._flush(outbox)
                    self._wakeup.wait(self._idle_wait_s())
                self._flush(outbox)
        except BaseException as exc:  # the loop itself broke: fail everyone, keep the server up
            logger.exception("engine loop died")
            self._error = exc
            error = EngineDeadError(f"engine loop died: {exc!r}")
            outbox.extend((s, error) for s in self._running.values())
            with self._lock:
                outbox.extend((sub.stream, error) for sub in self._new)
                self._new.clear()
            self._running.clear()
        finally:
            self._flush(outbox)
            self._close_engine()

    def _gather_burst(self) -> None:
        """An idle engine handed requests waits while more keep coming, so that a burst's
        prompts are prefilled in one step: started with the first alone, the next step
        prefilled all the others while the first one's stream waited (Zen 5, 2 CPUs, 32 short
        prompts at once: a 600 ms gap between its first two tokens). It waits until no request
        has come for `burst_gap_s`, MAX_BURST_GAPS gaps in all, or until the prompts fill a
        step (the scheduler's token budget or seats). A request whose KV another worker
        computes has no prefill here to share, so it starts at once."""
        if self.burst_gap_s == 0 or self.engine.has_unfinished_requests():
            return
        config = self.engine.scheduler.config
        deadline = time.monotonic() + MAX_BURST_GAPS * self.burst_gap_s
        num_seen = 0
        while True:
            self._wakeup.clear()
            with self._lock:
                if self._idle_call is not None:
                    return  # new requests wait for it anyway
                new = list(self._new)
            if len(new) == num_seen or any(_is_remote_prefill(sub) for sub in new):
                return  # none came (woken by an abort or shutdown), or one starts at once
            if config.is_step_full(len(new), sum(len(sub.prompt_token_ids) for sub in new)):
                return
            num_seen = len(new)
            wait = min(self.burst_gap_s, deadline - time.monotonic())
            if wait <= 0 or not self._wakeup.wait(wait):
                return

    def _close_engine(self) -> None:
        # This thread owns the engine, so it releases the engine's resources (KV transport
        # threads, shared memory) on its way out.
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    def _apply_inbox(self, outbox: list[tuple[RequestStream, _StreamItem]]) -> None:
        with self._lock:
            new, self._new = ([], self._new) if self._idle_call else (self._new, [])
            aborts, self._aborts = self._aborts, []
        for sub in new:
            outbox.append((sub.stream, self._admit(sub)))
        for request_id in aborts:
            stream = self._running.pop(request_id, None)
            if stream is not None:
                outbox.append((stream, self._abort(request_id)))
        if new or aborts:
            self._publish_stats()

    def _run_idle_call(self) -> None:
        with self._lock:
            call = self._idle_call
        if call is None:
            return
        now = time.monotonic()
        if self.engine.has_unfinished_requests():
            if now < call.deadline:
                return
            outcome: tuple[Any, BaseException | None] = (
                None,
                TimeoutError(f"engine still busy after {call.deadline - call.queued_at:.0f} s"),
            )
        else:
            try:
                outcome = ((call.fn(self.engine), now - call.queued_at), None)
            except Exception as exc:
                outcome = (None, exc)
        with self._lock:
            self._idle_call = None
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is gone
            self._loop.call_soon_threadsafe(_settle, call.future, *outcome)
        self._wakeup.set()  # admit what waited

    def _admit(self, sub: _Submission) -> _StreamItem:
        stream = sub.stream
        try:
            self.engine.add_request(
                stream.request_id,
                sub.prompt_token_ids,
                sub.sampling_params,
                sub.kv_transfer_params,
                sub.arrival_time,
            )
        except InvalidParameterError as exc:
            return exc
        except Exception as exc:
            logger.exception("engine rejected request %s", stream.request_id)
            return RequestFailedError(f"engine could not add the request: {exc}")
        self._running[stream.request_id] = stream
        return _ACCEPTED

    def _step(self, outbox: list[tuple[RequestStream, _StreamItem]]) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing its %d requests", len(self._running))
            self._fail_running(outbox, RequestFailedError(f"engine step failed: {exc}"))
            return
        for output in outputs:
            stream = self._running.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if output.finished:
                del self._running[output.request_id]
            outbox.append((stream, output))
        self._publish_stats()

    def _fail_running(
        self, outbox: list[tuple[RequestStream, _StreamItem]], error: BaseException
    ) -> None:
        for request_id, stream in self._running.items():
            self.engine.abort_request(request_id)
            outbox.append((stream, error))
        self._running.clear()

    def _abort(self, request_id: str) -> _StreamItem:
        """Abort an admitted request; its final output (`finish_reason` abort) comes from the
        engine, which alone knows its counts and clocks."""
        output = self.engine.abort_request(request_id)
        return output if output is not None else RequestFailedError("request was aborted")

    def _abort_all(self, outbox: list[tuple[RequestStream, _StreamItem]]) -> None:
        for request_id, stream in self._running.items():
            outbox.append((stream, self._abort(request_id)))
        self._running.clear()
        with self._lock:  # late arrivals raced with begin_shutdown
            outbox.extend(
                (sub.stream, EngineDeadError("server is shutting down")) for sub in self._new
            )
            self._new.clear()
        self._publish_stats()

    def _shutdown_due(self) -> bool:
        deadline = self._shutdown_deadline
        if deadline is None:
            return False
        return time.monotonic() >= deadline or not self._running

    def _idle_wait_s(self) -> float:
        deadline = self._shutdown_deadline
        if deadline is None:
            return HEARTBEAT_INTERVAL_S
        return max(0.0, min(HEARTBEAT_INTERVAL_S, deadline - time.monotonic()))

    def _publish_stats(self) -> None:
        engine_stats = self.engine.get_stats()
        with self._lock:
            num_pending = len(self._new)
            self._num_engine_waiting = engine_stats.num_waiting
        self._stats = dataclasses.replace(
            engine_stats,
            num_waiting=engine_stats.num_waiting + num_pending,
            heartbeat=time.monotonic(),
        )

    def _flush(self, outbox: list[tuple[RequestStream, _StreamItem]]) -> None:
        """Hand this iteration's items to the event loop in one thread-safe call."""
        if not outbox:
            return
        items = list(outbox)
        outbox.clear()
        assert self._loop is not None
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_deliver, items)


def _is_remote_prefill(sub: _Submission) -> bool:
    return bool((sub.kv_transfer_params or {}).get("do_remote_prefill"))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(items: list[tuple[RequestStream, _StreamItem]]) -> None:
    for stream, item in items:
        stream._put(item)
