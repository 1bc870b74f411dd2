"""One simulated engine instance: the real core scheduler, with the cost model as its GPU."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.core.request import Request
from pdserve.core.scheduler import Scheduler, SchedulerOutput
from pdserve.sim.connector import SimKVConnector
from pdserve.sim.cost_model import CostModel, SeqWork, StepCost

# Every simulated sample is this token: requests run to max_tokens (ignore_eos), so the
# value never matters, and prompts carry unique ids so caches see no false sharing.
SAMPLED_TOKEN_ID = 1


@dataclass
class WorkerStats:
    """Totals over a run: steps taken and seconds of each cost component."""

    num_steps: int = 0
    busy_s: float = 0.0
    linear_s: float = 0.0
    attention_s: float = 0.0
    communication_s: float = 0.0
    overhead_s: float = 0.0
    num_batched_tokens: int = 0
    max_step_s: float = 0.0

    def add(self, cost: StepCost, num_tokens: int) -> None:
        self.num_steps += 1
        self.busy_s += cost.total_s
        self.linear_s += cost.linear_s
        self.attention_s += cost.attention_s
        self.communication_s += cost.communication_s
        self.overhead_s += cost.overhead_s
        self.num_batched_tokens += num_tokens
        self.max_step_s = max(self.max_step_s, cost.total_s)


class SimWorker:
    """Steps `Scheduler.schedule()` → cost model → `update_from_output()` on a simulated clock.

    Requests submitted while a step runs join the scheduler at the next step boundary, as
    with the engine thread; finished KV transfers are applied there too.
    """

    def __init__(
        self,
        worker_id: str,
        cost_model: CostModel,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        node: int,
        connector: SimKVConnector | None = None,
        seed: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.cost_model = cost_model
        # Step-time jitter draws: one stream per worker, reproducible per seed.
        self._rng = random.Random(f"{seed}:{worker_id}")
        self.node = node
        self.connector = connector
        self.scheduler = Scheduler(scheduler_config, cache_config, connector)
        self.is_busy = False
        self.stats = WorkerStats()
        self._inbox: list[Request] = []
        self._output: SchedulerOutput | None = None
        self._sampling: list[Request] = []
        # The requests the step that just finished computed for.
        self.last_scheduled: list[Request] = []

    def submit(self, request: Request) -> None:
        self._inbox.append(request)

    @property
    def is_idle(self) -> bool:
        """No step runs and the scheduler holds no request."""
        return not self.is_busy and not self.scheduler.has_unfinished_requests()

    @property
    def does_inbox_fill_a_step(self) -> bool:
        """Whether the requests waiting for the next step fill it (`is_step_full`)."""
        num_tokens = sum(r.num_prompt_tokens for r in self._inbox)
        return self.scheduler.config.is_step_full(len(self._inbox), num_tokens)

    def start_step(self, now: float) -> float | None:
        """Schedule and cost one step; returns when it ends, or None if nothing can run."""
        assert not self.is_busy
        for request in self._inbox:
            self.scheduler.add_request(request)
        self._inbox.clear()
        self.scheduler.update_kv_transfers()
        output = self.scheduler.schedule()
        if output.is_empty:
            return None
        batch = [
            SeqWork(s.num_new_tokens, s.request.num_computed_tokens, s.is_sampling)
            for s in output.scheduled
        ]
        # Whether a request samples depends on its progress before the step: note it now.
        self._sampling = [s.request for s in output.scheduled if s.is_sampling]
        cost = self.cost_model.step_cost(batch)
        cost = cost.scaled(self.cost_model.efficiency.draw_jitter(self._rng, cost.total_s))
        self.stats.add(cost, output.num_batched_tokens)
        self._output = output
        self.is_busy = True
        return now + cost.total_s

    def finish_step(self) -> tuple[list[Request], list[Request]]:
        """Apply the step's samples. Returns (requests that got a token, requests finished)."""
        output, sampling = self._output, self._sampling
        sampled = {r.request_id: SAMPLED_TOKEN_ID for r in sampling}
        finished = self.scheduler.update_from_output(output, sampled)
        self.last_scheduled = [s.request for s in output.scheduled]
        self._output, self._sampling = None, []
        self.is_busy = False
        return sampling, finished
