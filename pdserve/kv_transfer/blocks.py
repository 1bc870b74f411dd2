"""Moving KV blocks between cache tensors: the one copy primitive every transport uses.

All tensors here are (layer slices of) the KV cache layout
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.kv_transfer.protocol import KVLayout, KVProtocolError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise KVProtocolError(
        f"KV cache dtype {dtype} is not supported for transfer (supported: {sorted(TORCH_DTYPES)})"
    )


def layout_of(kv_cache: torch.Tensor, model_id: str) -> KVLayout:
    """The `KVLayout` of an engine's cache tensor."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise KVProtocolError(
            "kv_cache must have shape [num_layers, 2, num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {list(kv_cache.shape)}"
        )
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return KVLayout(
        model_id=model_id,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype_name(kv_cache.dtype),
    )


def check_cache(kv_cache: torch.Tensor, layout: KVLayout) -> None:
    """Raise unless `kv_cache` is a contiguous CPU cache tensor of `layout`."""
    if kv_cache.device.type != "cpu":
        # A GPU cache would need pinned host staging on both ends; not built yet.
        raise KVProtocolError(
            f"KV transfer needs the KV cache in CPU memory, got {kv_cache.device}"
        )
    if layout_of(kv_cache, layout.model_id) != layout:
        raise KVProtocolError(
            f"kv_cache {list(kv_cache.shape)} {kv_cache.dtype} does not match "
            f"the KV layout {layout}"
        )
    if not kv_cache.is_contiguous():
        raise KVProtocolError("kv_cache must be contiguous")


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce a block mapping into ``(src_start, dst_start, length)`` runs where both
    sides are consecutive, so each run is one strided copy."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def copy_blocks(
    dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]
) -> None:
    """``dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]]`` for every i, in one pass over the
    bytes (no gathered temporary). `dst` and `src` are contiguous, same layer count."""
    # As numpy byte arrays [layers * 2, num_blocks, block bytes]: a slice assignment costs a
    # few microseconds, a 6-d torch copy_ tens, and fragmented lists make one call per block.
    dst_bytes, src_bytes = _block_bytes(dst), _block_bytes(src)
    for s, d, n in block_runs(src_ids, dst_ids):
        dst_bytes[:, d : d + n] = src_bytes[:, s : s + n]


def _block_bytes(cache: torch.Tensor) -> np.ndarray:
    if not cache.is_contiguous():
        raise ValueError("copy_blocks needs contiguous tensors")
    num_layers, _, num_blocks = cache.shape[:3]
    return np.asarray(cache.view(torch.uint8)).reshape(num_layers * 2, num_blocks, -1)


# Above this many runs, one indexed torch call per layer beats a Python loop of slice copies.
_MAX_SLICE_RUNS = 8


class StagedBlocks:
    """Moves a fixed list of cache blocks to and from a contiguous staging layer (tcp path).

    ``gather(src, out)``: ``out[:, :, i] = src[:, :, ids[i]]``;
    ``scatter(dst, src)``: ``dst[:, :, ids[i]] = src[:, :, i]``. Few runs of consecutive ids
    are copied as slices; fragmented lists use one index_select / index_copy_ call.
    """

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = tuple(ids)
        self._staging_ids = range(len(self._ids))
        self._index = None
        if len(block_runs(self._ids, self._staging_ids)) > _MAX_SLICE_RUNS:
            self._index = torch.tensor(self._ids, dtype=torch.int64)

    def gather(self, src: torch.Tensor, out: torch.Tensor) -> None:
        if self._index is None:
            copy_blocks(out, self._staging_ids, src, self._ids)
        else:
            torch.index_select(src, 2, self._index, out=out)

    def scatter(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._index is None:
            copy_blocks(dst, self._ids, src, self._staging_ids)
        else:
            dst.index_copy_(2, self._index, src)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor (for socket send / recv_into)."""
    flat = tensor.reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return memoryview(np.asarray(flat.view(torch.uint8))).cast("B")


class StagingBuffer:
    """A reusable contiguous CPU buffer, grown on demand, so repeated transfers do not pay
    for fresh pages every time."""

    def __init__(self, layout: KVLayout) -> None:
        self._dtype = TORCH_DTYPES[layout.dtype]
        self._block_shape = layout.block_shape
        self._buffer = torch.empty(0, dtype=self._dtype)

    def layer(self, num_blocks: int) -> torch.Tensor:
        """A ``[1, 2, num_blocks, block_size, heads, dim]`` view: one layer's K and V."""
        shape = (1, 2, num_blocks, *self._block_shape)
        numel = 2 * num_blocks * math.prod(self._block_shape)
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=self._dtype)
        return self._buffer[:numel].view(shape)
