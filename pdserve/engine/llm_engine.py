"""The synchronous engine: scheduler + model runner + detokenizers, one `step()` at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from pdserve.core.config import CacheConfig
from pdserve.core.request import FinishReason, Request
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.core.scheduler import Scheduler
from pdserve.engine.config import DEFAULT_KV_CACHE_MEMORY_GB, EngineConfig
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestMetrics, RequestOutput
from pdserve.engine.sampler import SampledToken
from pdserve.model.kv_cache import kv_bytes_per_token
from pdserve.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    last_step_time: float | None


@dataclass
class _Tracked:
    """Engine-side state of one live request, beside the scheduler's `Request`."""

    request: Request
    detokenizer: Detokenizer
    metrics: RequestMetrics


class LLMEngine:
    """Continuous-batching engine. Single-threaded: call everything from one thread.

    `step()` is schedule → forward → update; see docs/architecture.md.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.model_name = self.loaded.name
        num_blocks = self._num_kv_blocks()
        self.max_model_len = min(self.model_config.max_position_embeddings,
                                 config.max_model_len or self.model_config.max_position_embeddings,
                                 num_blocks * config.block_size)
        scheduler_config = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        cache_config = CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._num_steps = 0
        self._last_step_time: float | None = None
        logger.info("engine ready: %s, %s on %s, %d KV blocks of %d, max_model_len %d, %s",
                    self.model_name, self.loaded.dtype, self.loaded.device, num_blocks,
                    config.block_size, self.max_model_len, config.scheduler.scheduling.value)

    @classmethod
    def from_args(cls, **kwargs) -> LLMEngine:
        """Build from flat keyword arguments (the CLI's names); see `engine.args`."""
        from pdserve.engine.args import engine_config_from_kwargs

        return cls(engine_config_from_kwargs(**kwargs))

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        gigabytes = self.config.kv_cache_memory_gb or DEFAULT_KV_CACHE_MEMORY_GB
        bytes_per_block = kv_bytes_per_token(self.model_config, self.loaded.dtype) * \
            self.config.block_size
        return max(int(gigabytes * 2**30 // bytes_per_block), 1)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None,
                    kv_transfer_params: dict | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises `InvalidParameterError` naming the field for bad input."""
        params = sampling_params or SamplingParams()
        self._validate_prompt(prompt_token_ids)
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_id=self.tokenizer.eos_token_id,
                          kv_transfer_params=kv_transfer_params)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(request, Detokenizer(self.tokenizer, params.stop),
                                             RequestMetrics(request.arrival_time))

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidParameterError(
                "prompt", f"has {len(prompt_token_ids)} tokens, but this model and KV cache "
                f"allow at most {self.max_model_len - 1} (max_model_len {self.max_model_len})")
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab_size})")

    def abort_request(self, request_id: str) -> None:
        if self.scheduler.abort_request(request_id) is not None:
            self._release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        prefilling = [s.request.request_id for s in scheduler_output.scheduled
                      if s.request.is_prefilling]
        start = time.monotonic()
        sampled = self.runner.execute(scheduler_output)
        finished = self.scheduler.update_from_output(
            scheduler_output, {rid: s.token_id for rid, s in sampled.items()})
        self._last_step_time = time.monotonic() - start
        self._num_steps += 1
        for request_id in prefilling:
            self._tracked[request_id].metrics.prefill_time += self._last_step_time
        finished_ids = {r.request_id for r in finished}
        now = time.monotonic()
        return [self._output_for(self._tracked[rid], token, now, rid in finished_ids)
                for rid, token in sampled.items()]

    def _output_for(self, tracked: _Tracked, token: SampledToken, now: float,
                    is_finished: bool) -> RequestOutput:
        request, metrics = tracked.request, tracked.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        tracked.detokenizer.add_tokens([token.token_id])
        if tracked.detokenizer.is_stopped and not is_finished:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP)
            is_finished = True
        if is_finished:
            metrics.finished_time = now
            self._release(request.request_id)
        metrics.first_scheduled_time = request.first_scheduled_time
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[token.token_id],
            new_text=tracked.detokenizer.take_new_text(is_final=is_finished),
            finished=is_finished, finish_reason=request.finish_reason if is_finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, metrics=metrics,
            logprobs=[token.logprob] if token.logprob is not None else None,
            kv_transfer_params=request.kv_transfer_params if is_finished else None)

    def _release(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.runner.sampler.release(request_id)

    # ---- introspection -----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        stats = self.scheduler.get_stats()
        manager = self.scheduler.block_manager
        return EngineStats(stats.num_running, stats.num_waiting, stats.kv_cache_usage,
                           manager.num_free_blocks, manager.num_blocks,
                           stats.prefix_cache_hit_rate, stats.num_preemptions, self._num_steps,
                           self._last_step_time)
