"""Paged attention: the per-step metadata and the backend that attends over the KV cache.

A step's flat batch mixes sequences with one new token (decodes, or prefill chunks of one) and
sequences with many (prefill chunks). Each query attends to its sequence's whole context, read
from the paged cache through the block table: causal within the new chunk, offset by the
tokens computed in earlier steps.

`AttentionBackend` is the seam for faster kernels: it receives the step's new K/V and the
cache and returns the attention output; `TorchAttentionBackend` is the reference used on CPU
and CUDA (torch SDPA for prefill chunks, batched matmuls over gathered K/V for decodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    """A sequence with more than one new token: rows [token_start, token_end) of the batch."""

    token_start: int
    token_end: int
    num_computed_tokens: int
    # Slots [seq_len] of the whole context and the mask [num_new, seq_len] (True: attend);
    # both None when the chunk starts the sequence and plain causal attention is exact.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one new token, attended together in one batched call."""

    # Their rows in the flat batch: a slice when they are contiguous, else an index tensor.
    token_index: slice | torch.Tensor
    # Slot [B, max_len] of each context position; positions past a sequence's length point at
    # its first slot (always written) and are masked out by `lengths`.
    slots: torch.Tensor
    lengths: torch.Tensor
    # Gather rows and additive masks per (num_kv_heads, num_slots, dtype), filled on first use
    # by the first layer and reused by the others.
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.slots.shape[0]

    def plan(self, num_kv_heads: int, num_slots: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the cache viewed as [2 * num_slots * num_kv_heads, head_dim] holding K then
        V of every (sequence, kv head, position), and the additive mask [B * kv_heads, 1, L]."""
        key = (num_kv_heads, num_slots, dtype)
        if key not in self.plans:
            heads = torch.arange(num_kv_heads, device=self.slots.device)
            k_rows = (self.slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
            rows = torch.cat((k_rows, k_rows + num_slots * num_kv_heads))
            max_len = self.slots.shape[1]
            positions = torch.arange(max_len, device=self.slots.device)
            is_padding = positions[None, :] >= self.lengths[:, None]
            bias = torch.zeros(is_padding.shape, dtype=dtype, device=self.slots.device)
            bias.masked_fill_(is_padding, float("-inf"))
            bias = bias[:, None, None, :].expand(-1, num_kv_heads, 1, -1).reshape(
                -1, 1, max_len)
            self.plans[key] = (rows, bias)
        return self.plans[key]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's flat batch of T tokens from S sequences.

    The first four fields are the contract any backend may rely on; the rest are helpers the
    reference backend precomputes once per step instead of once per layer.
    """

    query_start_loc: torch.Tensor  # [S + 1] int32 prefix sums of new tokens per sequence
    seq_lens: torch.Tensor  # [S] int32 context length after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    decode: DecodeBatch | None
    prefills: tuple[PrefillChunk, ...]

    @property
    def is_all_decode(self) -> bool:
        return not self.prefills

    @classmethod
    def build(cls, seqs: Sequence[tuple[Sequence[int], int, int]], block_size: int,
              device: torch.device | str) -> AttentionMetadata:
        """From (block_table, num_computed_tokens, num_new_tokens) per sequence, in the order
        their new tokens appear in the flat batch."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        num_new = [n for _, _, n in seqs]
        seq_lens = [c + n for _, c, n in seqs]
        for i, (table, computed, new) in enumerate(seqs):
            if new < 1 or computed < 0:
                raise ValueError(f"sequence {i}: num_new_tokens must be >= 1 and "
                                 f"num_computed_tokens >= 0, got {new} and {computed}")
            if len(table) * block_size < computed + new:
                raise ValueError(f"sequence {i}: {len(table)} blocks of {block_size} cannot "
                                 f"hold {computed + new} tokens")
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        block_tables = torch.tensor([_padded(t, max_blocks) for t, _, _ in seqs],
                                    dtype=torch.int64)
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(num_new))
        positions = torch.cat([torch.arange(c, c + n) for _, c, n in seqs])
        slot_mapping = _slots(block_tables[seq_index], positions[:, None], block_size)[:, 0]
        decode_ids = [i for i, n in enumerate(num_new) if n == 1]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device=device, dtype=torch.int32),
            slot_mapping=slot_mapping.to(device),
            num_tokens=starts[-1],
            max_query_len=max(num_new),
            max_seq_len=max(seq_lens),
            decode=_decode_batch(decode_ids, starts, seq_lens, block_tables, block_size,
                                 device) if decode_ids else None,
            prefills=tuple(_prefill_chunk(i, starts, seqs, block_tables, block_size, device)
                           for i, n in enumerate(num_new) if n > 1),
        )


def _padded(block_table: Sequence[int], length: int) -> list[int]:
    table = list(block_table[:length])
    return table + [0] * (length - len(table))


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int
           ) -> torch.Tensor:
    """Slots [N, L] of positions [N, L] of the sequences with block tables [N, max_blocks]."""
    blocks = torch.gather(block_tables, 1, positions // block_size)
    return blocks * block_size + positions % block_size


def _decode_batch(ids: list[int], starts: list[int], seq_lens: list[int],
                  block_tables: torch.Tensor, block_size: int, device: torch.device | str
                  ) -> DecodeBatch:
    rows = [starts[i] for i in ids]
    is_contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    token_index = (slice(rows[0], rows[0] + len(rows)) if is_contiguous
                   else torch.tensor(rows, device=device))
    lengths = torch.tensor([seq_lens[i] for i in ids])
    positions = torch.arange(int(lengths.max()))
    positions = torch.where(positions[None, :] < lengths[:, None], positions[None, :], 0)
    slots = _slots(block_tables[ids], positions, block_size)
    return DecodeBatch(token_index, slots.to(device), lengths.to(device))


def _prefill_chunk(i: int, starts: list[int], seqs: Sequence[tuple[Sequence[int], int, int]],
                   block_tables: torch.Tensor, block_size: int, device: torch.device | str
                   ) -> PrefillChunk:
    _, computed, new = seqs[i]
    if computed == 0:
        return PrefillChunk(starts[i], starts[i + 1], 0, None, None)
    context = torch.arange(computed + new)
    slots = _slots(block_tables[i:i + 1], context[None, :], block_size)[0]
    query_positions = torch.arange(computed, computed + new)
    mask = context[None, :] <= query_positions[:, None]
    return PrefillChunk(starts[i], starts[i + 1], computed, slots.to(device), mask.to(device))


class AttentionBackend:
    """Writes a step's new K/V into the paged cache and attends each query to its context."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (any strides),
        kv_layer [2, num_blocks, block_size, num_kv_heads, head_dim] (this layer's cache,
        updated in place) -> [T, num_heads * head_dim]."""
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Reference backend from plain torch ops; exact in float32, correct for GQA."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        slots = kv_layer.view(2, -1, num_kv_heads, head_dim)
        slots[0].index_copy_(0, meta.slot_mapping, k)
        slots[1].index_copy_(0, meta.slot_mapping, v)
        if meta.decode is not None and meta.decode.num_seqs == num_tokens:
            return self._decode(q, kv_layer, meta.decode)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if meta.decode is not None:
            out[meta.decode.token_index] = self._decode(q[meta.decode.token_index], kv_layer,
                                                        meta.decode)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_end)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], slots, chunk)
        return out

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: DecodeBatch
                ) -> torch.Tensor:
        # Fold the query heads sharing a KV head into that head's "queries" (GQA without
        # repeating K/V): scores [B * kv_heads, group, L] from one batched matmul.
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_layer.shape[-2]
        num_slots = kv_layer.shape[1] * kv_layer.shape[2]
        rows, bias = batch.plan(num_kv_heads, num_slots, q.dtype)
        kv = kv_layer.view(-1, head_dim).index_select(0, rows).view(
            2, num_seqs * num_kv_heads, -1, head_dim)
        q = q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.baddbmm(bias, q, kv[0].transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, kv[1]).view(num_seqs, num_heads * head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.context_slots is not None:
            context = slots.index_select(1, chunk.context_slots)  # [2, seq_len, kv_heads, D]
            k, v = context[0], context[1]
        # SDPA wants [batch, heads, tokens, head_dim]; transposed views, no copies.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=self.scale,
            enable_gqa=True)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)
