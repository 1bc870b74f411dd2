"""Runs one forward pass for a scheduled step and samples the requests that are due."""

from __future__ import annotations

import torch

from pdserve.core.scheduler import SchedulerOutput
from pdserve.engine.sampler import SampledToken, Sampler
from pdserve.kv_transfer.protocol import KVLayout
from pdserve.kv_transfer.shm import SharedKVCache
from pdserve.model.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    int64_tensor,
    kernel_attends,
    measure_prefill_choices,
    prefill_kernel_choice,
)
from pdserve.model.layers import bf16_linear_choice, measure_linear_choices
from pdserve.model.loader import LoadedModel


class ModelRunner:
    """Owns the model and its paged KV cache; turns a `SchedulerOutput` into sampled tokens.

    The KV cache is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        seed: int,
        kv_cache_dtype: torch.dtype | None = None,
        shared_kv_layout: KVLayout | None = None,
    ) -> None:
        """The cache is allocated here, in `kv_cache_dtype` (default: the model's dtype);
        with `shared_kv_layout` (that dtype's layout) in a shared-memory segment, which a
        KV transport's receivers on this host copy from directly."""
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.block_size = block_size
        self.kv_cache_segment: SharedKVCache | None = None
        if shared_kv_layout is not None:
            self.kv_cache_segment = SharedKVCache.create(shared_kv_layout, num_blocks)
            self.kv_cache = self.kv_cache_segment.tensor
        else:
            self.kv_cache = allocate_kv_cache(
                loaded.config, num_blocks, block_size, kv_cache_dtype or loaded.dtype, loaded.device
            )
        self.sampler = Sampler(seed)

    @property
    def kv_caches(self) -> torch.Tensor | SharedKVCache:
        """What KV connectors register: the cache, or the shared segment holding it."""
        return self.kv_cache_segment or self.kv_cache

    def measure_kernel_choices(self, max_num_new: int, max_model_len: int, budget_s: float) -> None:
        """Measure, before serving, the kernel choices that chunks of up to `max_num_new` new
        tokens in sequences of up to `max_model_len` meet (a first long prompt would wait for
        them otherwise)."""
        measure_linear_choices(self.model.decoder_linears(), max_num_new, budget_s)
        ops = self.model.cpu_ops
        if ops is None or not kernel_attends(
            ops, self.device, self.model.dtype, self.kv_cache.dtype, self.config.head_dim
        ):
            return
        measure_prefill_choices(
            ops,
            self.model.dtype,
            self.kv_cache.dtype,
            self.config,
            max_num_new,
            max_model_len,
            budget_s,
        )

    def measure_when_idle(self) -> bool:
        """Measure one kernel-choice case that serving met unmeasured; whether there was one."""
        ops = self.model.cpu_ops
        return ops is not None and (
            prefill_kernel_choice(ops).measure_pending()
            or bf16_linear_choice(ops).measure_pending()
        )

    def close(self) -> None:
        """Unlink the shared segment (mappings stay valid while referenced)."""
        if self.kv_cache_segment is not None:
            self.kv_cache_segment.close()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        """Forward the step's flat batch; return the sampled token of each sampling request."""
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        sampling_rows = []  # the flat batch's row of each sampling request's last new token
        requests = []  # the sampling requests, in that order
        for scheduled in output.scheduled:
            request = scheduled.request
            start = request.num_computed_tokens
            end = start + scheduled.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            seqs.append((request.block_table, start, scheduled.num_new_tokens))
            if scheduled.is_sampling:
                # The last new token of a request that catches up is the one that predicts.
                sampling_rows.append(len(positions) - 1)
                requests.append(request)
        metadata = AttentionMetadata.build(seqs, self.block_size, self.device)
        hidden = self.model(
            int64_tensor(input_ids, self.device),
            int64_tensor(positions, self.device),
            self.kv_cache,
            metadata,
        )
        if not sampling_rows:
            return {}
        if len(sampling_rows) < len(positions):  # else every row samples (all decodes)
            hidden = hidden[int64_tensor(sampling_rows, self.device)]
        logits = self.model.compute_logits(hidden)
        sampled = self.sampler(logits, requests)
        return {r.request_id: s for r, s in zip(requests, sampled, strict=True)}
