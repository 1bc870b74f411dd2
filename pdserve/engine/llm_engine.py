"""The synchronous engine: scheduler + model runner + detokenizers, one `step()` at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.core.kv_connector import KVConnectorBase, KVOutcome, MultiConnector
from pdserve.core.request import FinishReason, Request, RequestMetrics
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.core.scheduler import EngineStats, Scheduler
from pdserve.engine.config import DEFAULT_NUM_THREADS, EngineConfig
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampler import SampledToken
from pdserve.engine.step_log import StepLog, StepRecord, step_batch
from pdserve.kv_store import KVStore, KVStoreMetrics, LayoutFingerprint
from pdserve.kv_store.connector import KVStoreConnector
from pdserve.kv_store.keys import model_identity
from pdserve.kv_transfer.config import KVRole
from pdserve.kv_transfer.connector import KVConnector
from pdserve.kv_transfer.protocol import KVLayout
from pdserve.model.attention import kv_bytes_per_token, resolve_kv_cache_dtype
from pdserve.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)
# How long an idle step waits when only KV transfers are in flight.
KV_POLL_INTERVAL_S = 0.001
# Startup time for measuring kernel choices (what is left over stays on the default until a
# later start measures it: `MeasuredChoice.skipped`).
KERNEL_CHOICE_BUDGET_S = 15.0


@dataclass
class _Tracked:
    """Engine-side state of one live request, beside the scheduler's `Request`."""

    request: Request
    detokenizer: Detokenizer
    # What the KV connectors did for it: its KV from a prefill worker (decode legs), what
    # the shared KV store gave its prompt.
    kv: KVOutcome = dataclasses.field(default_factory=KVOutcome)


class LLMEngine:
    """Continuous-batching engine. Single-threaded: call everything from one thread.

    `step()` is schedule → forward → update; see docs/architecture.md.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        # One compute thread unless told otherwise: see README "CPU speed" (two OpenMP
        # threads stall whenever another thread holds the second core).
        torch.set_num_threads(config.num_threads or DEFAULT_NUM_THREADS)
        self.config = config
        self.loaded = loaded or load_model(
            config.model, config.dtype, config.device, config.quantization
        )
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.loaded.dtype)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.model_name = self.loaded.name
        # The model config's EOS ids (generation_config.json's list, GGUF eos + eot) and the
        # tokenizer's.
        tokenizer_eos = self.tokenizer.eos_token_id
        self._eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            {tokenizer_eos} if tokenizer_eos is not None else set()
        )
        num_blocks = self._num_kv_blocks()
        self.max_model_len = min(
            self.model_config.max_position_embeddings,
            config.scheduler.max_model_len or self.model_config.max_position_embeddings,
            num_blocks * config.cache.block_size,
        )
        scheduler_config = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        cache_config = dataclasses.replace(config.cache, num_blocks=num_blocks)
        is_shared = config.kv_transfer is not None and config.kv_transfer.needs_shared_cache
        self.runner = ModelRunner(
            self.loaded,
            num_blocks,
            config.cache.block_size,
            config.seed,
            self.kv_cache_dtype,
            shared_kv_layout=self.kv_layout() if is_shared else None,
        )
        # The one connector the engine talks to (none, one, or several as one).
        self.kv_connector = MultiConnector(*self._make_connectors())
        self.kv_connector.register_kv_caches(self.runner.kv_caches)
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            self.kv_connector if self.kv_connector.connectors else None,
        )
        self.runner.measure_kernel_choices(
            scheduler_config.max_chunk_tokens, self.max_model_len, KERNEL_CHOICE_BUDGET_S
        )
        self._tracked: dict[str, _Tracked] = {}
        # Hand-offs to announce at the next step, before the request computes (streamed
        # prefill legs: the router starts the decode leg on them).
        self._announced: list[tuple[str, dict]] = []
        self._num_steps = 0
        self._last_step_time: float | None = None
        # Called with every step's `StepRecord` (batch and wall time), e.g. a `StepLog`.
        self.step_observers: list[Callable[[StepRecord], None]] = []
        self._step_log = StepLog(config.step_log) if config.step_log else None
        if self._step_log is not None:
            self.step_observers.append(self._step_log)
        logger.info(
            "engine ready: %s, %s on %s, %d KV blocks of %d, max_model_len %d, %s",
            self.model_name,
            self.loaded.dtype,
            self.loaded.device,
            num_blocks,
            config.cache.block_size,
            self.max_model_len,
            config.scheduler.scheduling.value,
        )

    @classmethod
    def from_args(cls, **kwargs) -> LLMEngine:
        """Build from flat keyword arguments (the CLI's names); see `EngineConfig.from_kwargs`."""
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _make_connectors(self) -> list[KVConnectorBase]:
        """KV transfer first (it serves a decode leg's tokens before the store is asked)."""
        connectors: list[KVConnectorBase] = []
        if self.config.kv_transfer is not None:
            connectors.append(
                KVConnector(
                    self.config.kv_transfer,
                    self.kv_layout(),
                    recompute_on_failure=self.config.kv_failure_policy == "recompute",
                )
            )
        if self.config.kv_store is not None:
            connectors.append(self._make_store_connector())
        return connectors

    def _make_store_connector(self) -> KVStoreConnector:
        """The shared KV store's connector (`--kv-store`)."""
        identity = model_identity(self.model_name, self.loaded.path)
        fingerprint = LayoutFingerprint.from_layout(
            dataclasses.replace(self.kv_layout(), model_id=identity),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            quantization=self.config.quantization,
        )
        store = KVStore(self.config.kv_store, fingerprint, metrics=KVStoreMetrics(self.model_name))
        logger.info(
            "KV store %s, namespace %r, keys pdserve:kv:%s:*",
            self.config.kv_store.redacted_url,
            self.config.kv_store.namespace,
            store.keys.salt,
        )
        return KVStoreConnector(store)

    def kv_layout(self) -> KVLayout:
        """What this engine's KV blocks mean, for checking a transfer's other end."""
        config = self.model_config
        return KVLayout(
            model_id=self.model_name,
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=self.config.cache.block_size,
            dtype=str(self.kv_cache_dtype).removeprefix("torch."),
        )

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        bytes_per_block = (
            kv_bytes_per_token(self.model_config, self.kv_cache_dtype) * cache.block_size
        )
        return max(int(cache.kv_cache_memory_gb * 2**30 // bytes_per_block), 1)

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        kv_transfer_params: dict | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises `InvalidParameterError` naming the field for bad input."""
        params = sampling_params or SamplingParams()
        self._validate_prompt(prompt_token_ids)
        vocab_size = self.model_config.vocab_size
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidParameterError(
                "stop_token_ids", f"must be below the vocabulary size {vocab_size}"
            )
        if request_id in self._tracked:  # refused before the connector records it
            raise ValueError(f"request_id {request_id!r} is already in use")
        admission = self.kv_connector.add_request(
            request_id, kv_transfer_params, len(prompt_token_ids)
        )
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self._eos_token_ids,
            metrics=RequestMetrics() if arrival_time is None else RequestMetrics(arrival_time),
            output_token_ids=list(admission.output_token_ids),
        )
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(request, Detokenizer(self.tokenizer, params.stop))
        if admission.hand_off is not None:
            self._announced.append((request_id, admission.hand_off))

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidParameterError(
                "prompt",
                f"has {len(prompt_token_ids)} tokens, but this model and KV cache "
                f"allow at most {self.max_model_len - 1} (max_model_len {self.max_model_len})",
            )
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab_size})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; returns its final output (None if it is not in flight)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or self.scheduler.abort_request(request_id) is None:
            return None
        return self._output_for(tracked, None, time.monotonic(), is_finished=True)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or KV blocks still moving (so `step()` keeps polling them)."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_transfers()

    # ---- the step ----------------------------------------------------------------------
    def measure_when_idle(self) -> bool:
        """Do one piece of the work left for idle time (a kernel-choice case serving met
        unmeasured); whether there was one. Call only with no request in flight."""
        return self.runner.measure_when_idle()

    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        outputs = self._announcements() + self._update_kv_transfers()
        if outputs:
            # Hand-offs to announce and first tokens whose KV has landed leave now, not a
            # forward pass later: the router starts a streamed leg's decode side before the
            # prompt's first chunk computes, and a decode leg's first token is on its way
            # while its second computes. The next call runs the forward pass.
            return outputs
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.has_pending_transfers():
                time.sleep(KV_POLL_INTERVAL_S)  # only transfers in flight: don't spin
            return outputs
        batch = step_batch(scheduler_output) if self.step_observers else ()
        prefilling = [s.request for s in scheduler_output.scheduled if s.request.is_prefilling]
        sampled = self.runner.execute(scheduler_output)
        finished = self.scheduler.update_from_output(
            scheduler_output, {rid: s.token_id for rid, s in sampled.items()}
        )
        # The one step timer: metrics, stats and step records all read this figure.
        self._last_step_time = time.perf_counter() - step_start
        self._num_steps += 1
        for request in prefilling:
            request.metrics.prefill_time += self._last_step_time
        self.kv_connector.save_after_step(scheduler_output, self._last_step_time)
        finished_ids = {r.request_id for r in finished}
        now = time.monotonic()
        outputs += [
            self._output_for(self._tracked[rid], token, now, rid in finished_ids)
            for rid, token in sampled.items()
        ]
        record = StepRecord(batch, self._last_step_time)
        for observe in self.step_observers:
            observe(record)
        return outputs

    def _announcements(self) -> list[RequestOutput]:
        """An output without tokens carrying each new streamed hand-off."""
        announced, self._announced = self._announced, []
        now = time.monotonic()
        outputs = []
        for request_id, hand_off in announced:
            tracked = self._tracked.get(request_id)
            if tracked is not None:  # not aborted meanwhile
                output = self._output_for(tracked, None, now, is_finished=False)
                output.kv_transfer_params = hand_off
                outputs.append(output)
        return outputs

    def _update_kv_transfers(self) -> list[RequestOutput]:
        """A decode leg's first token (sampled by the prefill worker) is emitted once its KV
        has arrived, or once it will be recomputed here; a failed leg ends with an error. A
        prompt read from the KV store just goes on to compute the rest."""
        update = self.scheduler.update_kv_transfers()
        now = time.monotonic()
        outputs = []
        for request in update.settled:
            tracked = self._tracked[request.request_id]
            outcome = self.kv_connector.take_result(request.request_id)
            tracked.kv = tracked.kv.merged(outcome)
            if outcome.transfer is None or not request.output_token_ids:
                continue  # not a decode leg's transfer, or its first token is computed here
            token = SampledToken(request.output_token_ids[0])
            outputs.append(self._output_for(tracked, token, now, is_finished=False))
        for request in update.failed:
            tracked = self._tracked[request.request_id]
            tracked.kv = tracked.kv.merged(self.kv_connector.take_result(request.request_id))
            outputs.append(self._output_for(tracked, None, now, is_finished=True))
        return outputs

    def _output_for(
        self, tracked: _Tracked, token: SampledToken | None, now: float, is_finished: bool
    ) -> RequestOutput:
        """The output for one new token (None: the request ends without one)."""
        request, metrics = tracked.request, tracked.request.metrics
        if token is not None:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            tracked.detokenizer.add_tokens([token.token_id])
        if tracked.detokenizer.is_stopped and not is_finished:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP)
            is_finished = True
        if is_finished:
            metrics.finished_time = now
            self._release(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token.token_id] if token is not None else [],
            new_text=tracked.detokenizer.take_new_text(is_final=is_finished),
            finished=is_finished,
            finish_reason=request.finish_reason if is_finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            # Not computed here: found in the local prefix cache or read from the KV store.
            num_cached_tokens=request.num_cached_tokens
            + (tracked.kv.store.num_hit_tokens if tracked.kv.store else 0),
            metrics=metrics,
            logprobs=[token.logprob] if token is not None and token.logprob else None,
            kv_transfer_params=request.kv_hand_off,
            kv_transfer=tracked.kv.transfer,
            kv_store=tracked.kv.store,
        )

    def _release(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.runner.sampler.release(request_id)

    def switch_kv_role(self, kv_role: KVRole) -> KVRole:
        """Take the other part in disaggregated serving (prefill ⇄ decode) in place: the
        weights, the KV cache and its prefix cache stay. Only with nothing in flight (no
        request, no KV held for or coming from another worker). Returns the previous role."""
        previous = self.kv_connector.kv_role
        if previous is None:
            raise ValueError("this worker takes no part in KV transfer (started without --role)")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot switch roles with requests or KV transfers in flight")
        self.kv_connector.switch_role(kv_role)
        logger.info("KV role: %s -> %s", previous.value, kv_role.value)
        return previous

    def shutdown(self) -> None:
        """Stop the KV connectors' threads and release the cache's shared memory."""
        self.kv_connector.close()
        self.runner.close()
        if self._step_log is not None:
            self._step_log.close()

    # ---- introspection -----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return dataclasses.replace(
            self.scheduler.get_stats(),
            num_steps=self._num_steps,
            last_step_time=self._last_step_time,
        )
