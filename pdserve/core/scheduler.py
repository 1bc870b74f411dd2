"""The scheduler: which requests compute how many tokens in the next step.

There are no phases. Every request has `num_computed_tokens` catching up to `num_tokens`; a step
gives each scheduled request `num_new_tokens` of that gap. Chunked prefill is just a per-step
token budget (`max_num_batched_tokens`): running decodes are taken first, then the oldest
partial prefill, then new prompts. Colocated scheduling takes waiting prompts whole, in a step
of their own, before any decode (classic continuous batching, which stalls running streams).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.core.block_manager import BlockManager
from pdserve.core.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from pdserve.core.kv_connector import KVConnectorScheduler
from pdserve.core.request import (
    FinishReason,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
)


class _Admission(enum.Enum):
    LOCAL = "local"  # computed here
    RECEIVING = "receiving"  # its KV is on its way from another worker
    NO_ROOM = "no_room"  # its KV comes from elsewhere but its blocks do not fit yet


@dataclass
class KVUpdate:
    """Result of `Scheduler.update_kv_transfers`."""

    # Left WAITING_FOR_REMOTE_KV: their KV arrived, or they will recompute it here.
    settled: list[Request] = field(default_factory=list)
    # Finished with an error because their KV never arrived (fail policy).
    failed: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    """The one stats snapshot. The scheduler fills the request and KV-cache fields; the
    engine adds its step count and latest step time, the async engine its heartbeat and the
    requests it has not handed to the engine yet (counted in `num_waiting`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    last_step_time: float | None = None
    # time.monotonic() of the engine loop's latest iteration (None: no loop runs it).
    heartbeat: float | None = None


class Scheduler:
    """Continuous-batching scheduler over a paged KV cache (see module docstring)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        if scheduler_config.max_model_len is None:
            raise ValueError("max_model_len must be resolved (the engine sets it at load time)")
        self.config = scheduler_config
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        # Holding blocks while their KV arrives from another worker.
        self.receiving: dict[str, Request] = {}
        # Finished, but their blocks are still read or written by the connector.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request now (abort, stop string found by the detokenizer); frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif self.receiving.pop(request_id, None) is None:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.connector is not None:
            is_held, request.kv_hand_off = self.connector.request_finished(request)
            if is_held:
                self.held[request_id] = request
                return request
        self.block_manager.free(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=manager.usage,
            num_free_blocks=manager.num_free_blocks,
            num_total_blocks=manager.num_blocks,
            prefix_cache_hit_rate=manager.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
        )

    # ---- scheduling --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.scheduling is SchedulingPolicy.COLOCATED:
            self._schedule_waiting(output, budget, is_chunking=False)
            if output.is_empty:
                self._schedule_running(output, budget=None)
        else:
            budget = self._schedule_running(output, budget)
            self._schedule_waiting(output, budget, is_chunking=True)
        now = time.monotonic()
        for scheduled in output.scheduled:
            scheduled.request.status = RequestStatus.RUNNING
            if scheduled.request.metrics.first_scheduled_time is None:
                scheduled.request.metrics.first_scheduled_time = now
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int | None) -> int | None:
        """Decodes first, then partial prefills oldest first. Returns the budget left."""
        ordered = sorted(self.running, key=lambda r: r.is_prefilling)  # stable: keeps age order
        for request in ordered:
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                break
            if not self._allocate_or_preempt(request, num_new, output):
                continue
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget = None if budget is None else budget - num_new
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, is_chunking: bool) -> None:
        """Admit waiting requests in FCFS order while blocks, seats and budget last.

        Without chunking a prompt is taken whole (alone if it exceeds the budget)."""
        num_partial = sum(1 for s in output.scheduled if not s.is_sampling)
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            # A request arriving with blocks (its KV was received) has nothing to look up.
            computed = (
                [] if request.block_table else self.block_manager.get_computed_blocks(request)
            )
            admission = self._start_receiving(request, computed)
            if admission is _Admission.RECEIVING:
                continue
            if admission is _Admission.NO_ROOM:
                return
            num_hit = len(computed) * self.block_manager.block_size
            remaining = request.num_tokens - request.num_computed_tokens - num_hit
            if is_chunking:
                num_new = self._cap(remaining, budget, request.is_prefilling)
                if num_new < remaining and num_partial >= self.config.max_num_partial_prefills:
                    return
            elif remaining > budget and not output.is_empty:
                return
            else:
                num_new = remaining
            if not self.block_manager.allocate_slots(request, num_new, computed):
                return
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, 0)
            self.waiting.popleft()
            self.running.append(request)
            scheduled = ScheduledRequest(request, num_new)
            output.scheduled.append(scheduled)
            num_partial += not scheduled.is_sampling
            budget -= num_new

    def _start_receiving(self, request: Request, computed: list[int]) -> _Admission:
        """Admit a request whose KV comes from another worker: allocate its blocks and
        hand them to the connector. A request whose KV does not fit waits (never silently
        recomputed): it keeps its place in the queue until blocks free up."""
        if self.connector is None:
            return _Admission.LOCAL
        num_local = request.num_computed_tokens + len(computed) * self.block_manager.block_size
        num_external = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external == 0:
            return _Admission.LOCAL
        if not self.block_manager.allocate_slots(request, num_external, computed):
            return _Admission.NO_ROOM
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_external_tokens = num_external
        self.receiving[request.request_id] = request
        self.connector.update_state_after_alloc(request, num_external)
        return _Admission.RECEIVING

    def update_kv_transfers(self) -> KVUpdate:
        """Apply finished transfers: received requests become runnable, failed ones are
        recomputed here or failed (the connector's policy), released blocks are freed."""
        update = KVUpdate()
        if self.connector is None:
            return update
        events = self.connector.get_finished()
        for request_id in events.finished_sending | events.finished_recving | events.failed_recving:
            held = self.held.pop(request_id, None)
            if held is not None:
                self.block_manager.free(held)
        for request_id in events.failed_recving & self.receiving.keys():
            if self.connector.recompute_on_failure:
                request = self.receiving.pop(request_id)
                self._requeue(request)
                update.settled.append(request)
            else:
                update.failed.append(self.finish_request(request_id, FinishReason.ERROR))
        for request_id in events.finished_recving & self.receiving.keys():
            request = self.receiving.pop(request_id)
            request.num_computed_tokens += request.num_external_tokens
            request.num_external_tokens = 0
            self.block_manager.cache_full_blocks(request)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            update.settled.append(request)
        return update

    def has_pending_transfers(self) -> bool:
        """Blocks still being received or held for a reader elsewhere."""
        return bool(self.receiving or self.held)

    def _num_new_tokens(self, request: Request, budget: int | None) -> int:
        return self._cap(request.num_remaining_tokens, budget, request.is_prefilling)

    def _cap(self, num_tokens: int, budget: int | None, is_prefill: bool) -> int:
        """`num_tokens` within the budget; a prompt's chunk also within the long-prefill
        threshold while other requests share the engine. The threshold bounds how long a
        chunk stalls their streams or delays their prompts; a prompt alone stalls nobody, so
        it takes the whole budget (3,000 tokens at 2 threads, Sapphire Rapids: 2 steps
        instead of 6, 20% sooner, as 2,048-row GEMMs use both cores where 512-row ones do
        not)."""
        if budget is not None:
            num_tokens = min(num_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        if is_prefill and threshold is not None and budget is not None and self._is_shared:
            num_tokens = min(num_tokens, threshold)
        return max(num_tokens, 0)

    @property
    def _is_shared(self) -> bool:
        """More than one request runs or waits (a request being scheduled is one of them)."""
        return len(self.running) + len(self.waiting) > 1

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Find blocks for `request`, preempting the newest unscheduled running requests
        (possibly `request` itself) until they fit. Returns whether `request` still runs."""
        while not self.block_manager.allocate_slots(request, num_new):
            # Built only when blocks run out: per request it would make every step O(n²).
            scheduled = {id(s.request) for s in output.scheduled}
            victims = [r for r in self.running if id(r) not in scheduled]
            victim = victims[-1]  # never empty: `request` itself is unscheduled
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self._requeue(request)
        if self.connector is not None:
            self.connector.request_preempted(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted.append(request)

    def _requeue(self, request: Request) -> None:
        """Free the request's blocks; it recomputes later (its full blocks may stay cached)."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_external_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ---- after the forward pass --------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that stop.

        `sampled` maps request id to the token sampled for each request that sampled.
        Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            self.block_manager.cache_full_blocks(request)
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            reason = request.check_stop(self.config.max_model_len)
            if reason is not None:
                finished.append(self.finish_request(request.request_id, reason))
        return finished
