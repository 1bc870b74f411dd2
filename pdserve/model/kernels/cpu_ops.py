"""Python side of `cpu_ops.c`: fused CPU kernels for the decoder's small, memory-bound steps.

Each replaces a chain of torch ops (whose dispatch costs more than their arithmetic at decode
sizes) with one call; `load_cpu_ops()` is None where they cannot be built, and callers then
use the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.model.cpu_runtime import read_cpu_flags
from pdserve.model.kernels.build import load_library

SOURCE = Path(__file__).with_name("cpu_ops.c")
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl"})
MAX_HEAD_DIM = 256
_UNIT = 16  # UNIT in the C source
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode": [_P] * 7 + [_I] * 6 + [_F],
    "add_rms_norm": [_P] * 4 + [_I] * 2 + [_F, _I],
    "rotary": [_P] + [_I] * 4 + [_P] * 2,
    "silu_mul": [_P] * 2 + [_I] * 2,
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_LINEAR_ARGS = [_P] * 4 + [_I] * 3
# Rows up to which `linear` beats oneDNN's GEMM (which wins on compute-bound larger batches).
LINEAR_MAX_ROWS = 8


class CpuOps:
    """The compiled kernels. All tensors must be contiguous CPU tensors of one supported dtype
    unless a method says otherwise; `supports` tells whether a dtype is covered."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                function = getattr(library, f"{name}_{suffix}")
                function.argtypes = argtypes
                function.restype = None
                self._functions[name, dtype] = function
        # Only compiled where the CPU has AVX-512 BF16 dot products.
        self._linear = getattr(library, "linear_bf16", None)
        if self._linear is not None:
            self._linear.argtypes = _LINEAR_ARGS
            self._linear.restype = None

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _SUFFIX

    def can_pack_linear(self, weight: torch.Tensor) -> bool:
        out_features, in_features = weight.shape
        return (
            self._linear is not None
            and weight.dtype == torch.bfloat16
            and out_features % 16 == 0
            and in_features % 2 == 0
        )

    @staticmethod
    def pack_linear(weight: torch.Tensor) -> torch.Tensor:
        """W [out, in] -> [out / 16, in / 2, 16, 2], the layout `linear` streams."""
        out_features, in_features = weight.shape
        return (
            weight.view(out_features // 16, 16, in_features // 2, 2)
            .permute(0, 2, 1, 3)
            .contiguous()
        )

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, in] W^T (+ bias) -> [rows, out] bfloat16, for W packed by `pack_linear`;
        fastest for rows <= LINEAR_MAX_ROWS."""
        x = x.contiguous()
        rows, in_features = x.shape
        out_features = packed.shape[0] * 16
        y = x.new_empty(rows, out_features)
        self._linear(
            packed.data_ptr(),
            x.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            out_features,
            in_features,
        )
        return y

    def paged_decode(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one query per sequence over its paged context. q [B, num_heads,
        head_dim] (any strides), kv_layer [2, num_blocks, block_size, num_kv_heads, head_dim],
        block_tables [B, max_blocks] and seq_lens [B] int64 (valid block ids)
        -> [B, num_heads * head_dim]."""
        num_seqs, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_layer.shape
        if not (
            kv_layer.is_contiguous()
            and block_tables.is_contiguous()
            and block_tables.dtype == seq_lens.dtype == torch.int64
        ):
            raise ValueError("the kernel needs a contiguous cache and int64 block tables")
        if head_dim % 16 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}")
        q = q.contiguous()
        out = q.new_empty(num_seqs, num_heads * head_dim)
        scratch = torch.empty(num_heads * (2 * head_dim + _UNIT + 2), dtype=torch.float32)
        self._functions["paged_decode", q.dtype](
            q.data_ptr(),
            kv_layer[0].data_ptr(),
            kv_layer[1].data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.shape[1],
            scale,
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual), x [rows, hidden]; `residual` is
        updated in place. With residual None: (rms_norm(x) * weight, x)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, hidden = x.shape
        self._functions["add_rms_norm", x.dtype](
            x.data_ptr(),
            (x if residual is None else residual).data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            residual is not None,
        )
        return out, x if residual is None else residual

    def rotary_(
        self, x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate heads [0, num_heads) of every row of x [rows, >= num_heads * head_dim] (rows
        may be strided, each row contiguous) in place; cos/sin float32 [rows, head_dim/2]."""
        if x.stride(1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rotary_ needs contiguous rows and contiguous cos/sin")
        self._functions["rotary", x.dtype](
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            num_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2 * width] = [gate | up] -> [rows, width]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        self._functions["silu_mul", gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out


@functools.cache
def load_cpu_ops() -> CpuOps | None:
    """The kernels, compiled on first use; None on CPUs without AVX-512 (F, BW, VL) or without
    a C compiler."""
    if not REQUIRED_CPU_FLAGS.issubset(read_cpu_flags()):
        return None
    library = load_library(SOURCE)
    return None if library is None else CpuOps(library)
