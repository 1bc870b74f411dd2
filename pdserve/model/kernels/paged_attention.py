"""Python side of `paged_attention.c`: decode attention straight from the paged KV cache."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.model.cpu_runtime import read_cpu_flags
from pdserve.model.kernels.build import load_library

SOURCE = Path(__file__).with_name("paged_attention.c")
MAX_HEAD_DIM = 256
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_DECODE_ARGS = [_P] * 7 + [_I] * 6 + [_F]
_UNIT = 16  # UNIT in the C source
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


class PagedAttentionKernel:
    """Attention of one query token per sequence over its paged context (CPU, AVX-512)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = {}
        for dtype, suffix in _SUFFIX.items():
            function = getattr(library, f"paged_decode_{suffix}")
            function.argtypes = _DECODE_ARGS
            function.restype = None
            self._decode[dtype] = function

    def supports(self, q: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and q.dtype in _SUFFIX and q.shape[-1] % 16 == 0
                and q.shape[-1] <= MAX_HEAD_DIM)

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, num_heads, head_dim], kv_layer [2, num_blocks, block_size, num_kv_heads,
        head_dim], block_tables [B, max_blocks] and seq_lens [B] int64 (valid block ids)
        -> [B, num_heads * head_dim]."""
        num_seqs, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_layer.shape
        if not (kv_layer.is_contiguous() and block_tables.is_contiguous()
                and block_tables.dtype == seq_lens.dtype == torch.int64):
            raise ValueError("the kernel needs a contiguous cache and int64 block tables")
        q = q.contiguous()
        out = q.new_empty(num_seqs, num_heads * head_dim)
        scratch = torch.empty(num_heads * (2 * head_dim + _UNIT + 2), dtype=torch.float32)
        self._decode[q.dtype](
            q.data_ptr(), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
            scale)
        return out


@functools.cache
def load_paged_attention_kernel() -> PagedAttentionKernel | None:
    """The kernel, compiled on first use; None on CPUs without AVX-512 or without a compiler."""
    if "avx512f" not in read_cpu_flags():
        return None
    library = load_library(SOURCE)
    return None if library is None else PagedAttentionKernel(library)
