"""Python side of `paged_decode.c`: decode attention straight from the paged KV cache."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.model.cpu_runtime import read_cpu_flags
from pdserve.model.kernels.build import load_library

SOURCE = Path(__file__).with_name("paged_decode.c")
MAX_HEAD_DIM = 256
_INT64 = ctypes.c_int64
_POINTER = ctypes.c_void_p
_ARGTYPES = [_POINTER] * 7 + [_INT64] * 7 + [ctypes.c_float]


class PagedDecodeKernel:
    """Attention of one query token per sequence over its paged context (CPU, AVX-512)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {torch.bfloat16: library.paged_decode_bf16,
                           torch.float32: library.paged_decode_f32}
        for function in self._functions.values():
            function.argtypes = _ARGTYPES
            function.restype = None

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in self._functions and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
        """q [B, num_heads, head_dim] (rows may be strided), kv_layer [2, num_blocks,
        block_size, num_kv_heads, head_dim], block_tables [B, max_blocks] and seq_lens [B]
        int64 with valid block ids -> [B, num_heads * head_dim]."""
        num_seqs, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_layer.shape
        q = q.contiguous()
        out = q.new_empty(num_seqs, num_heads * head_dim)
        scratch = torch.empty(num_heads * (2 * head_dim + max_len), dtype=torch.float32)
        self._functions[q.dtype](
            q.data_ptr(), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
            max_len, scale)
        return out


@functools.cache
def load_paged_decode_kernel() -> PagedDecodeKernel | None:
    """The kernel, compiled on first use; None on CPUs without AVX-512 or without a compiler."""
    if "avx512f" not in read_cpu_flags():
        return None
    library = load_library(SOURCE)
    return None if library is None else PagedDecodeKernel(library)
