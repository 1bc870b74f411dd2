"""Discrete-event cluster simulation over the real core scheduler and the router's policies.

Events (arrivals, step ends, KV transfer progress, metric scrapes, autoscaler ticks) run in
time order on a simulated clock; nothing sleeps. Each worker is a `SimWorker`: the real
`Scheduler` and `BlockManager` (and, disaggregated, the scheduler side of a KV connector),
with the cost model in place of the forward pass. Ties at one instant run in the order they
were queued, so a run is a pure function of its config and requests.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from pdserve.core.config import MAX_BURST_GAPS
from pdserve.core.request import Request, RequestMetrics
from pdserve.core.sampling_params import SamplingParams
from pdserve.router.config import KVHandoff
from pdserve.router.policies import PoolRole
from pdserve.router.pool import Worker
from pdserve.sim.autoscale import SimAutoscaler
from pdserve.sim.config import PoolConfig, SimConfig
from pdserve.sim.connector import SimKVConnector
from pdserve.sim.cost_model import CostModel
from pdserve.sim.handoff import exposed_fraction
from pdserve.sim.network import NETWORKS, Interconnect
from pdserve.sim.router import Route, SimRouter
from pdserve.sim.transfers import Channel, Transfer, TransferNetwork
from pdserve.sim.worker import SimWorker, WorkerStats
from pdserve.sim.workload import SimRequestSpec
from pdserve.workload.records import RequestRecord

# Prompt token ids: a request's own tokens start with a unique id, a shared prefix with its
# group's id, so block hashes match exactly where real prompts would share text.
_UNIQUE_BASE = 1 << 20
_PREFIX_BASE = 1 << 30
_FILL_TOKEN_ID = 7


@dataclass
class Pool:
    name: str
    config: PoolConfig
    cost_model: CostModel
    workers: list[SimWorker]
    num_kv_blocks: int


@dataclass
class SimResult:
    """Everything a run produced; `pdserve.sim.report` turns it into metrics and JSON.

    `records` are the benchmark's per-request records (the client's view), in request order;
    `server_extra` carries the simulated breakdown (prefill, KV transfer, preemptions).
    """

    config: SimConfig
    records: list[RequestRecord]
    pool_stats: dict[str, list[WorkerStats]]
    num_kv_blocks: dict[str, int]
    duration_s: float
    wall_time_s: float
    num_events: int
    # With --autoscale: decisions, what they did, worker-seconds (`SimAutoscaler.summary`).
    autoscale: dict | None = None


@dataclass
class _KVFlight:
    """A KV transfer's bookkeeping, carried through the network as its payload."""

    record: RequestRecord
    request: Request
    source: SimWorker
    destination: SimWorker
    start_time: float
    latency_s: float


class Simulation:
    """One run of `config` on `requests` (see module docstring)."""

    def __init__(self, config: SimConfig, requests: Sequence[SimRequestSpec]) -> None:
        self.config = config
        self.specs = list(requests)
        self.records = {
            s.request_id: RequestRecord(i, s.kind, s.prompt_len, s.output_len, s.arrival_time)
            for i, s in enumerate(self.specs)
        }
        if len(self.records) != len(self.specs):
            raise ValueError("request ids must be unique")
        self._index = {s.request_id: i for i, s in enumerate(self.specs)}
        self._transfer_started: set[str] = set()
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._pending_kicks: set[str] = set()
        # Idle workers gathering a burst: when their first request came, and the number of
        # their latest deadline (a deadline an arrival replaced is stale).
        self._gathering: dict[str, tuple[float, int]] = {}
        self._gather_deadline_ids = itertools.count()
        self._client_queue: deque[SimRequestSpec] = deque()
        self._num_in_flight = 0
        self._num_open = len(self.specs)
        self._routes: dict[str, Route] = {}
        # Streamed hand-offs: per prefill leg, when its first chunk's step ended and how many
        # chunks it took; then, once it finished, (seconds of compute after the first chunk,
        # chunks) for its transfer.
        self._streams: dict[str, tuple[float, int]] = {}
        self._stream_hiding: dict[str, tuple[float, int]] = {}
        self._network = TransferNetwork()
        self._network_generation = 0
        self._channels: dict[tuple[str, int], Channel] = {}
        self._next_device = 0
        self._num_workers_made: dict[str, int] = {}
        # Workers an autoscaler removed, with their pool's name.
        self.retired: list[tuple[str, SimWorker]] = []
        self.prefill = self._build_pool("prefill", config.prefill_pool)
        self.main = self._build_pool("decode" if config.prefill_pool else "main", config.pool)
        self.router = SimRouter(
            self.prefill.workers if self.prefill else [], self.main.workers, config.router
        )
        self.autoscaler = SimAutoscaler(self, config.autoscale) if config.autoscale else None

    # ---- setup -------------------------------------------------------------------------
    def _build_pool(self, name: str, pool: PoolConfig | None) -> Pool | None:
        if pool is None:
            return None
        cfg = self.config
        cost = CostModel(
            cfg.model,
            cfg.hardware,
            pool.tp,
            dtype=cfg.dtype,
            kv_dtype=cfg.kv_dtype,
            efficiency=cfg.resolved_efficiency,
            inter_node_link=cfg.network,
        )
        built = Pool(name, pool, cost, [], self._num_kv_blocks(cost, pool.scheduler_config))
        built.workers = [self._new_worker(built) for _ in range(pool.num_workers)]
        return built

    def _new_worker(self, pool: Pool) -> SimWorker:
        cfg = self.config
        index = self._num_workers_made.get(pool.name, 0)
        self._num_workers_made[pool.name] = index + 1
        node = self._next_device // cfg.hardware.devices_per_node
        self._next_device += pool.config.tp
        cache = replace(cfg.cache, num_blocks=pool.num_kv_blocks)
        worker = SimWorker(
            f"{pool.name}-{index}",
            pool.cost_model,
            pool.config.scheduler_config,
            cache,
            node,
            seed=cfg.seed,
        )
        if cfg.prefill_pool is not None:
            worker.connector = SimKVConnector(partial(self._start_kv_transfer, worker))
            worker.scheduler.connector = worker.connector
        return worker

    # ---- the fleet changes of an autoscaler ------------------------------------------
    def _pool_of(self, role: PoolRole) -> Pool:
        return self.prefill if role is PoolRole.PREFILL else self.main

    def add_worker(self, role: PoolRole) -> SimWorker:
        """A new worker of the `role` pool, starting (the router routes to it once
        `router.add_worker` registers it)."""
        pool = self._pool_of(role)
        worker = self._new_worker(pool)
        pool.workers.append(worker)
        return worker

    def remove_worker(self, entry: Worker) -> None:
        """A drained worker leaves its pool (its step totals stay in `retired`)."""
        worker = self.router.sim_worker(entry.worker_id)
        self.router.remove_worker(entry)
        self._pool_of(entry.role).workers.remove(worker)
        self.retired.append((self._pool_of(entry.role).name, worker))

    def move_worker(self, entry: Worker, role: PoolRole) -> Worker:
        """A drained worker serves the `role` pool from now on (same engine, same cache)."""
        worker = self.router.sim_worker(entry.worker_id)
        self._pool_of(entry.role).workers.remove(worker)
        self._pool_of(role).workers.append(worker)
        return self.router.move_worker(entry, role)

    def schedule(self, when: float, handler: Callable[[object], None]) -> None:
        self._push(when, handler, None)

    @property
    def has_open_requests(self) -> bool:
        return self._num_open > 0

    def _num_kv_blocks(self, cost: CostModel, sched) -> int:
        cfg, cache = self.config, self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if not cfg.is_kv_cache_from_memory:
            num_bytes = cache.kv_cache_memory_gb * 2**30
            return max(int(num_bytes // (cost.kv_bytes_per_token * cache.block_size)), 1)
        tokens = cost.kv_capacity_tokens(
            sched.max_num_batched_tokens, sched.max_num_seqs, cfg.memory_utilization
        )
        return max(tokens // cache.block_size, 1)

    # ---- event loop --------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        for spec in self.specs:
            self._push(spec.arrival_time, self._on_arrival, spec)
        self._push(0.0, self._on_scrape, None)
        if self.autoscaler is not None:
            self.autoscaler.start()
        num_events = 0
        horizon = self.config.horizon_s
        while self._events:
            when, _, handler, arg = heapq.heappop(self._events)
            if horizon is not None and when > horizon:
                break
            self.now = when
            handler(arg)
            num_events += 1
        for record in self.records.values():
            if record.end_time is None and record.error is None:
                record.error = "incomplete: in flight when the simulation reached its horizon"
        pools = [p for p in (self.prefill, self.main) if p is not None]
        return SimResult(
            config=self.config,
            records=list(self.records.values()),
            pool_stats={
                p.name: [w.stats for w in p.workers]
                + [w.stats for name, w in self.retired if name == p.name]
                for p in pools
            },
            num_kv_blocks={p.name: p.num_kv_blocks for p in pools},
            duration_s=self.now,
            wall_time_s=time.perf_counter() - started,
            num_events=num_events,
            autoscale=self.autoscaler.summary() if self.autoscaler else None,
        )

    def _push(self, when: float, handler: Callable, arg: object) -> None:
        heapq.heappush(self._events, (when, next(self._seq), handler, arg))

    def _on_scrape(self, _: object) -> None:
        self.router.scrape()
        if self._num_open:
            self._push(self.now + self.config.router.health_interval_s, self._on_scrape, None)

    # ---- clients -----------------------------------------------------------------------
    def _on_arrival(self, spec: SimRequestSpec) -> None:
        cap = self.config.max_concurrency
        if cap is not None and self._num_in_flight >= cap:
            self._client_queue.append(spec)
        else:
            self._send(spec)

    def _send(self, spec: SimRequestSpec) -> None:
        record = self.records[spec.request_id]
        record.send_time = self.now
        self._num_in_flight += 1
        reason = self._rejection(spec)
        if reason is not None:
            record.error, record.end_time = f"rejected: {reason}", self.now
            self._end_request()
            return
        delay = self.config.resolved_efficiency.request_overhead_s
        if delay:
            self._push(self.now + delay, self._admit, spec)
        else:
            self._admit(spec)

    def _admit(self, spec: SimRequestSpec) -> None:
        """The front end has parsed and tokenized the request: route it to a worker."""
        token_ids = self._prompt_token_ids(spec)
        route = self.router.route(token_ids)
        self._routes[spec.request_id] = route
        if route.prefill is None:
            self._submit(route.decode, self._request(spec, token_ids, spec.output_len))
        else:
            route.prefill.connector.add_prefill_leg(spec.request_id)
            self._submit(route.prefill, self._request(spec, token_ids, 1))

    def _end_request(self) -> None:
        self._num_in_flight -= 1
        self._num_open -= 1
        if self._client_queue:
            self._send(self._client_queue.popleft())

    def _rejection(self, spec: SimRequestSpec) -> str | None:
        """Why a worker would refuse the request (the engine's add_request checks)."""
        max_model_len = self.config.pool.scheduler_config.max_model_len
        if spec.prompt_len >= max_model_len:
            return f"prompt of {spec.prompt_len} tokens does not fit max_model_len {max_model_len}"
        num_tokens = min(spec.prompt_len + spec.output_len, max_model_len)
        num_blocks = -(-num_tokens // self.config.cache.block_size)
        for pool in (self.prefill, self.main):
            if pool is not None and num_blocks > pool.num_kv_blocks:
                return (
                    f"{num_tokens} tokens exceed a worker's KV cache ({pool.num_kv_blocks} blocks)"
                )
        return None

    def _prompt_token_ids(self, spec: SimRequestSpec) -> list[int]:
        ids: list[int] = []
        if spec.prefix_group is not None and spec.prefix_len:
            ids = [_PREFIX_BASE + spec.prefix_group] + [_FILL_TOKEN_ID] * (spec.prefix_len - 1)
        num_own = spec.prompt_len - len(ids)
        if num_own:
            ids += [_UNIQUE_BASE + self._index[spec.request_id]]
            ids += [_FILL_TOKEN_ID] * (num_own - 1)
        return ids

    def _request(self, spec: SimRequestSpec, token_ids: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(
            spec.request_id,
            token_ids,
            params,
            metrics=RequestMetrics(arrival_time=self.now),
        )

    # ---- workers -----------------------------------------------------------------------
    def _submit(self, worker: SimWorker, request: Request, is_remote_prefill: bool = False) -> None:
        """Hand `request` to `worker`. An idle worker gathers a burst first, as the engine
        loop does (`AsyncLLMEngine._gather_burst`): it steps once no request has come for
        `burst_gap_s`, MAX_BURST_GAPS gaps after the first, or when the requests fill a step;
        a request whose KV another worker computed (`is_remote_prefill`) steps at once."""
        worker.submit(request)
        gap = self.config.burst_gap_s
        gathering = self._gathering.get(worker.worker_id)
        if (
            is_remote_prefill
            or gap == 0
            or worker.does_inbox_fill_a_step
            or (
                gathering is None
                and (not worker.is_idle or worker.worker_id in self._pending_kicks)
            )
        ):
            self._gathering.pop(worker.worker_id, None)
            self._kick(worker)
            return
        first = self.now if gathering is None else gathering[0]
        deadline_id = next(self._gather_deadline_ids)
        self._gathering[worker.worker_id] = (first, deadline_id)
        deadline = min(self.now + gap, first + MAX_BURST_GAPS * gap)
        self._push(deadline, self._on_gathered, (worker, deadline_id))

    def _on_gathered(self, arg: tuple[SimWorker, int]) -> None:
        worker, deadline_id = arg
        gathering = self._gathering.get(worker.worker_id)
        if gathering is None or gathering[1] != deadline_id:
            return  # a later request moved the deadline, or the gathering ended
        del self._gathering[worker.worker_id]
        self._kick(worker)

    def _kick(self, worker: SimWorker) -> None:
        """Start the worker's next step at the end of this instant (batches simultaneous
        arrivals into one step, as an engine loop would)."""
        if worker.worker_id in self._gathering:
            return  # its gathering's end starts the step
        if worker.worker_id not in self._pending_kicks and not worker.is_busy:
            self._pending_kicks.add(worker.worker_id)
            self._push(self.now, self._on_kick, worker)

    def _on_kick(self, worker: SimWorker) -> None:
        self._pending_kicks.discard(worker.worker_id)
        if worker.is_busy:
            return
        end = worker.start_step(self.now)
        if end is not None:
            self._push(end, self._on_step_done, worker)
        elif self.autoscaler is not None:
            self.autoscaler.on_idle(worker)

    def _on_step_done(self, worker: SimWorker) -> None:
        sampled, finished = worker.finish_step()
        if self.prefill is not None and worker in self.prefill.workers:
            if self.config.router.kv_handoff is KVHandoff.STREAM:
                for leg in worker.last_scheduled:
                    first_end, num_chunks = self._streams.get(leg.request_id, (self.now, 0))
                    self._streams[leg.request_id] = (first_end, num_chunks + 1)
            for leg in finished:
                self._on_prefill_done(worker, leg)
        else:
            for request in sampled:
                self._on_token(worker, request)
            for request in finished:
                self._on_finished(request)
        self._on_kick(worker)

    def _on_token(self, worker: SimWorker, request: Request) -> None:
        record = self.records[request.request_id]
        if self.autoscaler is not None:  # what the worker's TTFT / ITL histograms see
            if record.token_times:
                self.autoscaler.on_itl(worker, self.now - record.token_times[-1])
            else:
                self.autoscaler.on_ttft(worker, self.now - request.metrics.arrival_time)
        if not record.token_times:
            self._release_unread_kv(request.request_id)
        record.token_times.append(self.now)
        record.num_output_tokens += 1
        record.is_usage_reported = True

    def _on_finished(self, request: Request) -> None:
        record = self.records[request.request_id]
        _add_extra(record, "num_preemptions", request.num_preemptions)
        record.end_time = self.now
        self._routes.pop(request.request_id).decode_lease.release()
        self._end_request()

    # ---- disaggregation ----------------------------------------------------------------
    def _on_prefill_done(self, prefill_worker: SimWorker, leg: Request) -> None:
        """The prefill leg answered: the router sends the decode leg with the KV's address."""
        record = self.records[leg.request_id]
        record.server_extra["prefill_ms"] = (self.now - record.send_time) * 1000
        if self.autoscaler is not None:
            self.autoscaler.on_ttft(prefill_worker, self.now - leg.metrics.arrival_time)
        _add_extra(record, "num_preemptions", leg.num_preemptions)
        route = self._routes[leg.request_id]
        if leg.request_id in self._streams:
            # Streamed: the link carried the earlier chunks while the later ones computed.
            first_end, num_chunks = self._streams.pop(leg.request_id)
            self._stream_hiding[leg.request_id] = (self.now - first_end, num_chunks)
        route.prefill_lease.release()
        route.decode.connector.add_decode_leg(leg.request_id, leg.num_prompt_tokens, prefill_worker)
        spec = self.specs[record.index]
        # The prefill worker's first token leaves as the KV lands (`_on_kv_arrived`): the
        # decode worker computes the rest.
        max_tokens = spec.output_len - 1 if spec.output_len > 1 else 1
        decode_leg = self._request(spec, leg.prompt_token_ids, max_tokens)
        self._submit(route.decode, decode_leg, is_remote_prefill=True)

    def _start_kv_transfer(
        self, destination: SimWorker, request: Request, num_tokens: int, source: SimWorker
    ) -> None:
        """The decode worker allocated blocks for `num_tokens` remote tokens: pull them."""
        record = self.records[request.request_id]
        cost = source.cost_model
        num_bytes = num_tokens * cost.kv_bytes_per_token
        record.server_extra["kv_transfer_bytes"] = num_bytes
        self._transfer_started.add(request.request_id)
        link, channels = self._path(source, destination)
        num_devices = min(source.cost_model.tp, destination.cost_model.tp)
        cap = link.transfer_bandwidth(num_devices) * cost.efficiency.network
        hiding = self._stream_hiding.pop(request.request_id, None)
        if hiding is not None:  # only what the link could not hide is left to move
            num_bytes *= exposed_fraction(num_bytes, cap, *hiding)
        flight = _KVFlight(record, request, source, destination, self.now, link.latency_s)
        self._network.start(self.now, Transfer(num_bytes, channels, cap, flight))
        self._watch_network()

    def _release_unread_kv(self, request_id: str) -> None:
        """A decode leg that never fetched (its prefix was cached locally, or the prompt was
        one token) tells the prefill worker to drop the blocks it holds."""
        route = self._routes[request_id]
        if route.prefill is not None and request_id not in self._transfer_started:
            route.prefill.connector.mark_sent(request_id)
            self._kick(route.prefill)

    def _path(self, src: SimWorker, dst: SimWorker) -> tuple[Interconnect, tuple[Channel, ...]]:
        """Same node: the node's intra-node fabric. Otherwise: src egress, dst ingress."""
        if src.node == dst.node:
            link = NETWORKS[self.config.hardware.intra_node_link]
            return link, (self._channel(link, "intra", src.node),)
        link = self.config.network
        return link, (
            self._channel(link, "egress", src.node),
            self._channel(link, "ingress", dst.node),
        )

    def _channel(self, link: Interconnect, kind: str, node: int) -> Channel:
        key = (kind, node)
        if key not in self._channels:
            capacity = link.node_bandwidth * self.config.resolved_efficiency.network
            self._channels[key] = Channel(f"{kind}-{node}", capacity)
        return self._channels[key]

    def _watch_network(self) -> None:
        # Rates change on every start/finish: only the newest prediction stays valid.
        self._network_generation += 1
        when = self._network.next_completion_time()
        if when is not None:
            self._push(when, self._on_network, self._network_generation)

    def _on_network(self, generation: int) -> None:
        if generation != self._network_generation:
            return
        for transfer in self._network.advance(self.now):
            flight = transfer.payload
            self._push(self.now + flight.latency_s, self._on_kv_arrived, flight)
        self._watch_network()

    def _on_kv_arrived(self, flight: _KVFlight) -> None:
        request_id = flight.request.request_id
        flight.record.server_extra["kv_transfer_ms"] = (self.now - flight.start_time) * 1000
        if not flight.record.token_times and self.specs[flight.record.index].output_len > 1:
            # The engine emits the prefill worker's first token as its KV lands, before the
            # decode worker's next forward pass (a one-token answer is the decode worker's).
            self._on_token(flight.destination, flight.request)
        flight.destination.connector.mark_received(request_id)
        flight.source.connector.mark_sent(request_id)
        self._kick(flight.destination)
        self._kick(flight.source)


def _add_extra(record: RequestRecord, key: str, value: int) -> None:
    record.server_extra[key] = record.server_extra.get(key, 0) + value


def simulate(config: SimConfig, requests: Sequence[SimRequestSpec]) -> SimResult:
    """Run `requests` through the deployment `config` and return what happened."""
    return Simulation(config, requests).run()
