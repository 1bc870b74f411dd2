"""Paged attention: the per-step metadata and the backend that attends over the KV cache.

A step's flat batch mixes sequences with one new token (decodes, or prefill chunks of one) and
sequences with many (prefill chunks). Each query attends to its sequence's whole context, read
from the paged cache through the block table: causal within the new chunk, offset by the
tokens computed in earlier steps.

`AttentionBackend` is the seam for faster kernels: it receives the step's new K/V and the
cache and returns the attention output. `TorchAttentionBackend` serves CPU and CUDA. On CPU,
native kernels (every ISA) read K/V in place through the block tables: decodes always, prefill
chunks (flash-style, causal, offset by the cached context) where they beat torch SDPA, as
measured on this machine per variant, dtypes, heads, threads and chunk/context size and
cached on disk (`prefill_kernel_choice`, `kernels/choice.py`): the engine measures the cases
its limits allow at startup (`measure_prefill_choices`); a case met unmeasured runs SDPA and
is measured when the engine is idle, never on a request's path. Elsewhere SDPA runs
prefill chunks, over the context gathered from the cache when there is one, and decodes are
batched matmuls over gathered K/V.
The cache may hold a narrower dtype than the model's (`--kv-cache-dtype bfloat16`): new K/V
are rounded once on write and read back in the model dtype.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.model.config import KV_CACHE_DTYPES, ModelConfig
from pdserve.model.cpu_runtime import huge_page_buffer
from pdserve.model.kernels.choice import MeasuredChoice, kernels_cache_dir, size_bucket
from pdserve.model.kernels.cpu_ops import CpuOps, empty_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillChunk:
    """A sequence with more than one new token: rows [token_start, token_end) of the batch."""

    token_start: int
    token_end: int
    num_computed_tokens: int
    block_table: torch.Tensor  # [context blocks] int64
    block_size: int

    @property
    def rows(self) -> slice:
        return slice(self.token_start, self.token_end)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + self.token_end - self.token_start

    @functools.cached_property
    def context_mask(self) -> torch.Tensor:
        """[num_new, seq_len] bool, True where the query at that row sees that position (all
        earlier tokens, and the chunk causally), for paths that gather the context."""
        context = torch.arange(self.seq_len, device=self.block_table.device)
        query_positions = context[self.num_computed_tokens :]
        return context[None, :] <= query_positions[:, None]


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one new token, attended together in one batched call."""

    # Their rows in the flat batch: a slice when they are contiguous, else an index tensor.
    token_index: slice | torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    seq_lens: torch.Tensor  # [B] int64
    max_len: int
    block_size: int
    # Gather rows and masks of the torch path, per (num_kv_heads, num_slots, dtype); built by
    # the first layer that needs them and reused by the others.
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def gather_plan(
        self, num_kv_heads: int, num_slots: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the cache viewed as [2 * num_slots * num_kv_heads, head_dim] holding K then
        V of every (sequence, kv head, position), and the additive mask [B * kv_heads, 1, L]
        (positions past a sequence's end read its first slot, masked out)."""
        key = (num_kv_heads, num_slots, dtype)
        if key not in self.plans:
            device = self.seq_lens.device
            positions = torch.arange(self.max_len, device=device)
            is_padding = positions[None, :] >= self.seq_lens[:, None]
            positions = positions.masked_fill(is_padding, 0)
            slots = (
                torch.gather(self.block_tables, 1, positions // self.block_size) * self.block_size
                + positions % self.block_size
            )
            heads = torch.arange(num_kv_heads, device=device)
            k_rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
            rows = torch.cat((k_rows, k_rows + num_slots * num_kv_heads))
            bias = torch.zeros(is_padding.shape, dtype=dtype, device=device)
            bias.masked_fill_(is_padding, float("-inf"))
            bias = bias[:, None, :].repeat_interleave(num_kv_heads, dim=0)
            self.plans[key] = (rows, bias)
        return self.plans[key]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's flat batch of T tokens from S sequences.

    Built once per step (every layer reads it), in plain Python over the sequences and their
    blocks: a decode step's build is part of every token's latency, and per-sequence numpy or
    torch calls cost more than the arithmetic they carry at these sizes.
    """

    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token
    num_tokens: int
    max_block_id: int
    decode: DecodeBatch | None
    prefills: tuple[PrefillChunk, ...]

    @property
    def is_all_decode(self) -> bool:
        return not self.prefills

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[Sequence[int], int, int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """From (block_table, num_computed_tokens, num_new_tokens) per sequence, in the order
        their new tokens appear in the flat batch."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        slots: list[int] = []
        decodes: list[tuple[int, list[int], int]] = []  # (row, context blocks, seq_len)
        prefills = []
        max_block_id = 0
        for i, (block_table, num_computed, num_new) in enumerate(seqs):
            if num_new < 1 or num_computed < 0:
                raise ValueError(
                    "every sequence needs num_new_tokens >= 1 and num_computed_tokens >= 0"
                )
            seq_len = num_computed + num_new
            table = _context_blocks(i, block_table, seq_len, block_size)
            max_block_id = max(max_block_id, max(table))
            row = len(slots)
            _extend_slots(slots, table, num_computed, seq_len, block_size)
            if num_new == 1:
                decodes.append((row, table, seq_len))
            else:
                blocks = int64_tensor(table, device)
                prefills.append(PrefillChunk(row, row + num_new, num_computed, blocks, block_size))
        return cls(
            slot_mapping=int64_tensor(slots, device),
            num_tokens=len(slots),
            max_block_id=max_block_id,
            decode=_decode_batch(decodes, block_size, device) if decodes else None,
            prefills=tuple(prefills),
        )


def _context_blocks(
    index: int, block_table: Sequence[int], seq_len: int, block_size: int
) -> list[int]:
    """The blocks a context of seq_len tokens occupies, checked: enough of them, none negative."""
    num_blocks = -(-seq_len // block_size)
    if len(block_table) < num_blocks:
        raise ValueError(
            f"sequence {index}: {len(block_table)} blocks of {block_size} cannot hold "
            f"{seq_len} tokens"
        )
    table = list(block_table[:num_blocks])
    if min(table) < 0:
        raise ValueError("block ids must be non-negative")
    return table


def _extend_slots(
    slots: list[int], table: list[int], start: int, end: int, block_size: int
) -> None:
    """Append the cache slots of positions [start, end), a range per block they cross."""
    while start < end:
        block = start // block_size
        stop = min(end, (block + 1) * block_size)
        base = (table[block] - block) * block_size
        slots.extend(range(base + start, base + stop))
        start = stop


def _decode_batch(
    decodes: list[tuple[int, list[int], int]], block_size: int, device: torch.device | str
) -> DecodeBatch:
    rows = [row for row, _, _ in decodes]
    first = rows[0]
    is_contiguous = rows == list(range(first, first + len(rows)))
    tables = np.zeros((len(decodes), max(len(table) for _, table, _ in decodes)), np.int64)
    for i, (_, table, _) in enumerate(decodes):
        tables[i, : len(table)] = table
    lens = [seq_len for _, _, seq_len in decodes]
    return DecodeBatch(
        slice(first, first + len(rows)) if is_contiguous else int64_tensor(rows, device),
        torch.from_numpy(tables).to(device),
        int64_tensor(lens, device),
        max(lens),
        block_size,
    )


def int64_tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """A list of ints as an int64 tensor: through numpy, as `torch.tensor` on a Python list
    takes ~3x as long (58 against 18 us for 1,000 ints, on a step's path)."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


class AttentionBackend:
    """Writes a step's new K/V into the paged cache and attends each query to its context."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (any strides),
        kv_layer [2, num_blocks, block_size, num_kv_heads, head_dim] (this layer's cache,
        updated in place) -> [T, num_heads * head_dim]."""
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: exact in float32, correct for GQA. With `cpu_ops` (CPU tensors of
    a dtype they support), decodes run in the native kernel."""

    def __init__(self, scale: float, cpu_ops: CpuOps | None = None) -> None:
        self.scale = scale
        self.cpu_ops = cpu_ops

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if meta.max_block_id >= kv_layer.shape[1]:
            raise ValueError(
                f"block id {meta.max_block_id} is outside the KV cache ({kv_layer.shape[1]} blocks)"
            )
        kernel = (
            self.cpu_ops
            if kernel_attends(self.cpu_ops, q.device, q.dtype, kv_layer.dtype, head_dim)
            else None
        )
        if kernel is None or not kernel.write_kv(k, v, kv_layer, meta.slot_mapping):
            slots = kv_layer.view(2, -1, k.shape[1], head_dim)  # [2, num_slots, kv_heads, D]
            slots[0].index_copy_(0, meta.slot_mapping, k.to(kv_layer.dtype))
            slots[1].index_copy_(0, meta.slot_mapping, v.to(kv_layer.dtype))
        decode = meta.decode
        if decode is not None and decode.num_seqs == num_tokens:
            return self._decode(q, kv_layer, decode, kernel)
        if len(meta.prefills) == 1 and decode is None:
            chunk = meta.prefills[0]
            return self._prefill(
                q, k, v, kv_layer, chunk, self._prefill_kernel(kernel, q, kv_layer, chunk)
            )
        out = empty_rows(num_tokens, num_heads * head_dim, q.dtype)
        if decode is not None:
            out[decode.token_index] = self._decode(q[decode.token_index], kv_layer, decode, kernel)
        for chunk in meta.prefills:
            rows = chunk.rows
            prefill_kernel = self._prefill_kernel(kernel, q, kv_layer, chunk)
            # The kernel writes its rows in place: a copy would wake torch's sleeping OpenMP
            # threads (~75 us a chunk on a 2-vCPU VM), more than a short chunk's attention.
            chunk_out = self._prefill(
                q[rows], k[rows], v[rows], kv_layer, chunk, prefill_kernel, out=out[rows]
            )
            if prefill_kernel is None:
                out[rows] = chunk_out
        return out

    @staticmethod
    def _prefill_kernel(
        kernel: CpuOps | None, q: torch.Tensor, kv_layer: torch.Tensor, chunk: PrefillChunk
    ) -> CpuOps | None:
        """`kernel` where its paged prefill beats SDPA on this chunk's case here, else None."""
        if kernel is None:
            return None
        case = prefill_case(
            q.dtype,
            kv_layer.dtype,
            q.shape[1],
            kv_layer.shape[-2],
            q.shape[2],
            chunk.token_end - chunk.token_start,
            chunk.num_computed_tokens,
        )
        is_kernel_faster = prefill_kernel_choice(kernel).a_wins_or(case, default=False)
        return kernel if is_kernel_faster else None

    def _decode(
        self, q: torch.Tensor, kv_layer: torch.Tensor, batch: DecodeBatch, kernel: CpuOps | None
    ) -> torch.Tensor:
        if kernel is not None:
            return kernel.paged_decode(q, kv_layer, batch.block_tables, batch.seq_lens, self.scale)
        # Fold the query heads sharing a KV head into that head's "queries" (GQA without
        # repeating K/V): scores [B * kv_heads, group, L] from one batched matmul.
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_layer.shape[-2]
        num_slots = kv_layer.shape[1] * kv_layer.shape[2]
        rows, bias = batch.gather_plan(num_kv_heads, num_slots, q.dtype)
        kv = (
            kv_layer.view(-1, head_dim)
            .index_select(0, rows)
            .view(2, num_seqs * num_kv_heads, -1, head_dim)
            .to(q.dtype)
        )
        q = q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.add(bias, torch.bmm(q, kv[0].transpose(1, 2)), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, kv[1]).view(num_seqs, num_heads * head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        chunk: PrefillChunk,
        kernel: CpuOps | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chunk's attention output [num_new, num_heads * head_dim]; the kernel writes it
        into `out` where given, SDPA returns a new tensor."""
        if kernel is not None:  # K/V of the whole context read in place from the cache
            return kernel.paged_prefill(
                q,
                kv_layer,
                chunk.block_table,
                chunk.num_computed_tokens,
                self.scale,
                torch.get_num_threads(),
                out,
            )
        mask = None
        if chunk.num_computed_tokens:  # attend to the cached context too: gather it by blocks
            mask = chunk.context_mask
            blocks = kv_layer.index_select(1, chunk.block_table)  # [2, blocks, bs, kv_heads, D]
            context = blocks.view(2, -1, k.shape[1], k.shape[2])[:, : chunk.seq_len]
            k, v = context[0].to(q.dtype), context[1].to(q.dtype)
        # SDPA wants [batch, heads, tokens, head_dim]; transposed views, no copies.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)


# ---- which prefill attention runs: measured here ------------------------------------------


def prefill_case(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_new: int,
    num_computed: int,
) -> tuple:
    """The case `prefill_kernel_choice` measures a chunk as: dtypes, heads, torch's threads
    and the new tokens and cached context, each rounded up to a power of two."""
    return (
        str(q_dtype).removeprefix("torch."),
        str(kv_dtype).removeprefix("torch."),
        num_heads,
        num_kv_heads,
        head_dim,
        torch.get_num_threads(),
        size_bucket(num_new),
        size_bucket(num_computed),
    )


def prefill_cases(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_num_new: int,
    max_model_len: int,
) -> list[tuple]:
    """Every `prefill_case` a chunk of 2..`max_num_new` new tokens can have in a sequence of at
    most `max_model_len` tokens, cheapest (new x context tokens) first."""
    smallest = size_bucket(1)

    def buckets(largest: int) -> list[int]:
        return [
            smallest << i
            for i in range(size_bucket(largest).bit_length() - smallest.bit_length() + 1)
        ]

    def fewest(bucket: int) -> int:  # the fewest tokens a bucket holds
        return min(bucket, bucket // 2 + 1)

    max_num_new = min(max_num_new, max_model_len)
    sizes = [
        (num_new, num_computed)
        for num_new in buckets(max_num_new)
        for num_computed in [0, *buckets(max_model_len - 2)]
        if max(2, fewest(num_new)) + (num_computed and fewest(num_computed)) <= max_model_len
    ]
    sizes.sort(key=lambda size: size[0] * (size[0] + size[1]))
    return [
        prefill_case(q_dtype, kv_dtype, num_heads, num_kv_heads, head_dim, *size) for size in sizes
    ]


def measure_prefill_choices(
    ops: CpuOps,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    config: ModelConfig,
    max_num_new: int,
    max_model_len: int,
    budget_s: float,
) -> None:
    """Measure (within `budget_s`) the prefill cases a model of `config` meets under these
    limits, so that serving never waits for a measurement; log what was chosen."""
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    cases = prefill_cases(q_dtype, kv_dtype, *heads, max_num_new, max_model_len)
    choice = prefill_kernel_choice(ops)
    start = time.perf_counter()
    num_measured = choice.measure(cases, budget_s)
    elapsed_s = time.perf_counter() - start
    measured = [case for case in cases if json.dumps(case) in choice.timings]
    sdpa = [case for case in measured if not choice.a_wins_or(case, default=False)]
    logger.info(
        "prefill attention (%s kernels, %s q / %s KV, %d x %d heads of %d, %d thread(s)): "
        "%d cases up to %d new tokens in %d, %d measured now in %.1f s, %d left to SDPA "
        "(beyond the startup budget: the next start goes on); the kernel on %d, SDPA on %d "
        "(new/context tokens: %s)",
        ops.isa,
        *(str(dtype).removeprefix("torch.") for dtype in (q_dtype, kv_dtype)),
        *heads,
        torch.get_num_threads(),
        len(cases),
        max_num_new,
        max_model_len,
        num_measured,
        elapsed_s,
        len(cases) - len(measured),
        len(measured) - len(sdpa),
        len(sdpa),
        " ".join(f"{case[-2]}/{case[-1]}" for case in sdpa) or "-",
    )


def kernel_attends(
    ops: CpuOps | None,
    device: torch.device,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
) -> bool:
    """Whether `ops`' attention kernels serve these tensors (else torch ops do)."""
    return (
        ops is not None
        and device.type == "cpu"
        and ops.supports(q_dtype)
        and ops.supports(kv_dtype)
        and head_dim % 16 == 0
    )


@functools.cache
def prefill_kernel_choice(ops: CpuOps) -> MeasuredChoice:
    """Whether `ops.paged_prefill` (A) beats SDPA (B) per `prefill_case`, measured on this
    machine (`measure_prefill_choices`) and cached next to the compiled kernels."""
    return MeasuredChoice(
        f"prefill-attention-{ops.isa}",
        ops.build_id,
        functools.partial(prefill_paths, ops),
        kernels_cache_dir(),
        num_size_fields=2,  # new tokens, cached context
    )


def prefill_paths(ops: CpuOps, case: tuple) -> tuple[Callable[[], object], Callable[[], object]]:
    """(kernel, SDPA) runs of one layer's prefill attention for `case` on a synthetic context
    (random K/V in a shuffled paged cache of 16-token blocks), on the case's threads."""
    q_name, kv_name, num_heads, num_kv_heads, head_dim, threads, num_new, num_computed = case
    q_dtype, kv_dtype = getattr(torch, q_name), getattr(torch, kv_name)
    block_size, seq_len = 16, num_computed + num_new
    num_blocks = -(-seq_len // block_size)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
        kv_dtype
    )
    table = torch.randperm(num_blocks, generator=generator)
    meta = AttentionMetadata.build([(table.tolist(), num_computed, num_new)], block_size, "cpu")
    chunk = meta.prefills[0]
    q = torch.randn(num_new, num_heads, head_dim, generator=generator).to(q_dtype)
    k, v = cache.view(2, -1, num_kv_heads, head_dim)[:, meta.slot_mapping].to(q_dtype)
    backend = TorchAttentionBackend(head_dim**-0.5)

    def kernel():
        ops.paged_prefill(q, cache, chunk.block_table, num_computed, backend.scale, threads)

    def sdpa():
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            backend._prefill(q, k, v, cache, chunk)
        finally:
            torch.set_num_threads(previous)

    return kernel, sdpa


# ---- the paged KV cache -------------------------------------------------------------------
# One tensor for all layers: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
# head_dim]. A token at position p of a sequence lives in slot
# `block_table[p // block_size] * block_size + p % block_size`; a block is contiguous per
# layer and per K/V, which is what KV transfer moves.


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zero-filled cache (zeros so that no read ever meets uninitialised NaNs), on a CPU in
    2 MiB pages (`huge_page_buffer`: decode streams it)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}"
        )
    shape = (
        config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
    )
    if torch.device(device).type == "cpu":
        # Written now: a decode step's first write to a page would clear (perhaps compact
        # for) 2 MiB mid-step (served ITL p99 of 8 streams x1.4-2 with the KV left unwritten).
        cache = huge_page_buffer(math.prod(shape) * dtype.itemsize).zero_()
        return cache.view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` (one of KV_CACHE_DTYPES) -> the cache's dtype; auto: the model's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return model_dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return (
        config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element_size
    )
