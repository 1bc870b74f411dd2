"""Python side of `cpu_ops.c`: fused CPU kernels for the decoder's memory-bound steps.

Each replaces a chain of torch ops (whose dispatch costs more than their arithmetic at decode
sizes) with one call. The library is compiled per ISA variant (`build.VARIANTS`);
`load_cpu_ops()` picks the best one this CPU runs, or the one `PDSERVE_CPU_ISA` names, once
per process; it is None where none can be built, and callers then use the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.cpu_runtime import BF16_MATMUL_CPU_FLAGS, read_cpu_flags
from pdserve.model.kernels.build import (
    VARIANT_NAMES,
    can_run,
    load_library,
    runnable_variants,
    variant,
)
from pdserve.model.kernels.choice import MeasuredChoice, kernels_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
ISA_ENV = "PDSERVE_CPU_ISA"
MAX_HEAD_DIM = 256
_UNIT = 16  # UNIT in the C source
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm": ([_C, *[_P] * 4, _I, _I, _F, _I, _I], None),
    "rotary": ([_C, _P, _I, _I, _I, _I, _P, _P, _I], None),
    "silu_mul": ([_C, _P, _P, _I, _I, _I], None),
    "silu_mul_threads": ([_I, _I], _I),
    "paged_decode": ([_C, _C, *[_P] * 7, *[_I] * 6, _F], None),
    "paged_prefill": ([_C, _C, _P, _I, _P, _P, _P, _I, _I, _P, _P, *[_I] * 4, _F, _I], None),
    "prefill_scratch_bytes": ([_I] * 4, _I),
    "prefill_threads": ([_I] * 5, _I),
    "linear": ([_C, _C, *[_P] * 4, _I, _I, _I, _P, _I], None),
    "linear_scratch": ([_C, _I, _I], _I),
    "linear_threads": ([_C, _I, _I, _I, _I], _I),
    "linear_has_amx": ([], _C),
    "linear_bf16_min_rows": ([_C], _I),
    "linear_split_x_max_rows": ([_C], _I),
    "linear_silu_mul": ([_C, _C, *[_P] * 3, _I, _I, _I, _P, _I], _C),
    "linear_silu_mul_min_rows": ([_C], _I),
    "set_linear_dpbf16_max_rows": ([_I], _C),
    "set_kv_prefetch_into_l1": ([_I], None),
    "stream_sum": ([_P, _I, _I], _F),
    "write_kv_rows": ([_C, _C, *[_P] * 2, _I, *[_P] * 3, _I, _I], None),
    "pdserve_isa": ([], ctypes.c_char_p),
    "pdserve_struct_sizes": ([_P], None),
    "decode_scratch_bytes": ([_P, _I, _I], _I),
    "decode_forward": ([_P, _I, *[_P] * 4, _I, _I, *[_P] * 3, _I, _P, _I], None),
}
# Rows up to which dense `linear` serves a step rather than oneDNN: bfloat16 where its rows
# run in AMX tiles or in bf16 dot products (Zen 4: decode steps of 16 and 32 sequences 10%
# faster than with oneDNN past 8 rows), and float32. Up to these rows, too, a decode step is
# one native call (`LlamaForCausalLM`'s fused decoder), which past them runs op by op: on
# Sapphire Rapids, 2 threads, decode steps of 48 and 64 sequences took 94 and 118 ms op by op
# against 47 and 58 in one call (bfloat16; float32 181 and 226 against 108 and 138). Also,
# oneDNN builds a primitive per new row count (3-5 ms per weight shape there), which
# prefill steps of a few short prompts each are. 64 is `max_num_seqs`' default.
BF16_KERNEL_MAX_ROWS = F32_KERNEL_MAX_ROWS = 64
# bf16 dot products (vdpbf16ps) serve one or two rows of x, or (where they measure faster at
# a full tile of DPBF16_TILE_ROWS rows, MAX_ROW_TILE in cpu_ops.c) every row count.
DPBF16_FEW_ROWS, DPBF16_TILE_ROWS, DPBF16_ALL_ROWS = 2, 8, 2**62
# Decode attention's KV prefetch is timed (`kv_prefetch_choice`) on this many sequences of
# KV_PREFETCH_CONTEXT positions over KV_PREFETCH_LAYERS layers of bfloat16 KV with SmolLM2's
# heads: 100 MB, about what a decode step of 8 sequences reads, beyond a Zen core complex's
# 32 MB of L3.
KV_PREFETCH_SEQS, KV_PREFETCH_CONTEXT, KV_PREFETCH_LAYERS = 8, 512, 32


def onednn_rows(rows: int) -> int:
    """The rows a oneDNN linear of `rows` rows computes where its input has room: `rows`
    rounded up to one of 8 sizes per doubling (multiples of 32 below 512).

    oneDNN builds a primitive, JIT code included, per row count and weight shape: 3-5 ms each
    on Sapphire Rapids, ~18 ms for a step of a new row count (a decoder layer's 4 shapes),
    which a step of a new mix of prompts and decodes usually is. The ~31 sizes up to the
    2,048-token budget, 4 shapes each, fit `ONEDNN_CACHE_CAPACITY`, so each is built once.
    """
    step = 1 << max(5, rows.bit_length() - 4)
    return -(-rows // step) * step


def empty_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, cols] activation; in bfloat16 the first rows of a buffer of
    `onednn_rows(rows)`, so the linear it feeds computes the padded rows in place of a new
    primitive. Only bfloat16: its oneDNN kernels (AMX, vdpbf16ps) treat denormal inputs as
    zero, so whatever the padding rows hold costs nothing and reaches no other row."""
    if dtype != torch.bfloat16:
        return torch.empty(rows, cols, dtype=dtype)
    return torch.empty(onednn_rows(rows), cols, dtype=dtype)[:rows]


# Element types (DT_* in simd.h).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class WeightFormat:
    """W_* in cpu_ops.c: how a packed weight stores its values."""

    F32 = 0
    BF16 = 1
    Q8_0 = 2
    Q4_0 = 3
    Q4_1 = 4
    INT8 = 5


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight in a kernel format: `data` holds groups of 16 output rows (the last
    zero-padded), see cpu_ops.c."""

    format: int
    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class CpuOps:
    """The compiled kernels of one ISA variant. All tensors must be contiguous CPU tensors of
    a dtype `supports` accepts unless a method says otherwise."""

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        self._lib = library
        self.dpbf16_max_rows = DPBF16_FEW_ROWS  # as cpu_ops.c starts; see tune_bf16_dot
        self.is_kv_prefetch_into_l1 = False  # as cpu_ops.c starts; see tune_kv_prefetch
        # The compiled file's name (variant + hash of source, flags and compiler).
        self.build_id = Path(library._name).name
        for name, (argtypes, restype) in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = restype
        built = library.pdserve_isa().decode()
        if built != isa:
            raise RuntimeError(f"kernel library reports ISA {built!r}, expected {isa!r}")
        check_struct_sizes(library)

    @property
    def has_bf16_dot(self) -> bool:
        """Whether bfloat16 weights are multiplied by bf16 dot-product instructions (else
        converted to float32 in registers)."""
        return self.isa in ("amx", "avx512_bf16")

    def bf16_min_rows(self, weight_format: int) -> int | None:
        """Rows from which weights of this packed format (int8 or GGUF) are dequantized and
        multiplied in bfloat16, in AMX tiles or bf16 dot products (x and each dequantized
        weight rounded to bfloat16 first, sums in float32), None: never."""
        return self._lib.linear_bf16_min_rows(weight_format) or None

    def split_x_max_rows(self, weight_format: int) -> int | None:
        """Rows up to which int8 weights are multiplied as they are, in AMX integer tiles, by x
        quantized to 16 bits per block of 32 (`quantize_activations(x, SPLIT_X_LEVELS)`),
        None: never."""
        return self._lib.linear_split_x_max_rows(weight_format) or None

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_CODES

    def dense_kernel_max_rows(self, dtype: torch.dtype) -> int | None:
        """Rows up to which `linear` beats oneDNN on dense weights of `dtype` (None: always).
        oneDNN's GEMMs win on compute-bound inputs: float32 ones, and bfloat16 where the CPU
        has bf16 matrix or dot-product instructions (AMX tiles: ~8x these kernels at 512
        rows); without them its bfloat16 path is slower than this one's at any size. With
        AMX tiles of its own (`linear_has_amx`), or bf16 dot products on every row count
        (`tune_bf16_dot`), `linear` keeps up to BF16_KERNEL_MAX_ROWS rows."""
        if dtype == torch.float32:
            return F32_KERNEL_MAX_ROWS
        if self._lib.linear_has_amx() or self.dpbf16_max_rows == DPBF16_ALL_ROWS:
            return BF16_KERNEL_MAX_ROWS
        return 8 if read_cpu_flags() & BF16_MATMUL_CPU_FLAGS else None

    # ---- linear ---------------------------------------------------------------------------
    @staticmethod
    def can_pack(weight: torch.Tensor) -> bool:
        """Whether `pack_dense` takes this [out, in] weight."""
        return weight.dtype == torch.float32 or (
            weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0
        )

    @staticmethod
    def pack_dense(weight: torch.Tensor) -> PackedWeight:
        """W [out, in] float32 -> [groups, in, 16]; bfloat16 -> [groups, in / 2, 16, 2]."""
        out_features, in_features = weight.shape
        groups = -(-out_features // 16)
        padded = torch.zeros(groups * 16, in_features, dtype=weight.dtype)
        padded[:out_features] = weight
        if weight.dtype == torch.float32:
            data = padded.view(groups, 16, in_features).transpose(1, 2).contiguous()
            return PackedWeight(WeightFormat.F32, data, out_features, in_features)
        data = padded.view(groups, 16, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
        return PackedWeight(WeightFormat.BF16, data, out_features, in_features)

    def linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, in] W^T (+ bias) -> [rows, out] in x's dtype, on up to torch's thread
        count (too little work to share runs on one)."""
        x = x.contiguous()
        y = x.new_empty(x.shape[0], weight.out_features)
        num_threads, scratch = self._linear_team(x, weight)
        self._lib.linear(
            weight.format,
            _DTYPE_CODES[x.dtype],
            weight.data.data_ptr(),
            x.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            weight.out_features,
            weight.in_features,
            scratch.data_ptr(),
            num_threads,
        )
        return y

    def fuses_silu_mul(self, weight: PackedWeight, rows: int, dtype: torch.dtype) -> bool:
        """Whether `linear_silu_mul` takes these [gate; up] weights and `rows` rows of x of
        `dtype`: weights that run in AMX tiles at that row count (bfloat16 ones with bfloat16
        x), gate and up each a whole number of groups of 16 outputs."""
        min_rows = self._lib.linear_silu_mul_min_rows(weight.format)
        if weight.format == WeightFormat.BF16 and (
            dtype != torch.bfloat16 or weight.in_features % 32
        ):
            return False
        return 0 < min_rows <= rows and weight.out_features % 32 == 0

    def linear_silu_mul(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """silu(x G^T) * (x U^T) for W = [G; U] (`weight`, [2 * width, in]) -> [rows, width]
        in x's dtype: `silu_mul(linear(x, weight, None))` without the [rows, 2 * width]
        product in memory. Only where `fuses_silu_mul` (elsewhere ValueError)."""
        x = x.contiguous()
        width = weight.out_features // 2
        y = x.new_empty(x.shape[0], width)
        num_threads, scratch = self._linear_team(x, weight)
        is_refused = self._lib.linear_silu_mul(
            weight.format,
            _DTYPE_CODES[x.dtype],
            weight.data.data_ptr(),
            x.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            width,
            weight.in_features,
            scratch.data_ptr(),
            num_threads,
        )
        if is_refused:
            raise ValueError(
                f"linear_silu_mul does not take weights of format {weight.format} "
                f"[{weight.out_features}, {weight.in_features}] at {x.shape[0]} rows here"
            )
        return y

    def _linear_team(self, x: torch.Tensor, weight: PackedWeight) -> tuple[int, torch.Tensor]:
        """The threads a linear of x by `weight` runs on, and their scratch."""
        rows = x.shape[0]
        num_threads = self._lib.linear_threads(
            weight.format, rows, weight.out_features, weight.in_features, torch.get_num_threads()
        )
        per_thread = self._lib.linear_scratch(weight.format, rows, weight.in_features)
        return num_threads, torch.empty(num_threads * per_thread, dtype=torch.uint8)

    def tune_bf16_dot(self) -> int | None:
        """Set the rows up to which bfloat16 linears use bf16 dot products, from the choice
        measured on this machine (`dpbf16_choice`); the rows set, None where this build has
        none or AMX tiles take those rows."""
        if not self.has_bf16_dot or self._lib.linear_has_amx():
            return None
        is_all_faster = dpbf16_choice(self).a_wins(("linear-dpbf16", DPBF16_TILE_ROWS))
        rows = DPBF16_ALL_ROWS if is_all_faster else DPBF16_FEW_ROWS
        self.set_dpbf16_max_rows(rows)
        logger.info(
            "bf16 linears: dot products for %s rows (measured here)",
            "every count of" if is_all_faster else f"up to {DPBF16_FEW_ROWS}",
        )
        return rows

    def tune_kv_prefetch(self) -> bool:
        """Set where decode attention prefetches its KV, L1 or L2, from the choice measured on
        this machine (`kv_prefetch_choice`); returns whether into L1."""
        is_l1 = kv_prefetch_choice(self).a_wins(("paged-decode-kv-prefetch", KV_PREFETCH_SEQS))
        self.set_kv_prefetch_into_l1(is_l1)
        where = "L1" if is_l1 else "L2"
        logger.info("decode attention: KV prefetched into %s (measured here)", where)
        return is_l1

    def set_kv_prefetch_into_l1(self, is_l1: bool) -> None:
        """Process-wide: decode attention prefetches its next KV blocks into L1 (else L2)."""
        self._lib.set_kv_prefetch_into_l1(int(is_l1))
        self.is_kv_prefetch_into_l1 = is_l1

    def set_dpbf16_max_rows(self, rows: int) -> None:
        """Process-wide: bfloat16 linears of up to `rows` rows use bf16 dot products."""
        self._lib.set_linear_dpbf16_max_rows(rows)
        self.dpbf16_max_rows = rows

    # ---- attention ------------------------------------------------------------------------
    def paged_decode(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one query per sequence over its paged context. q [B, num_heads,
        head_dim] (any strides), kv_layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        (float32 or bfloat16, maybe not q's dtype), block_tables [B, max_blocks] and seq_lens
        [B] int64 (valid block ids) -> [B, num_heads * head_dim] in q's dtype."""
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
        scratch = torch.empty(num_heads * (2 * head_dim + _UNIT + 17), dtype=torch.float32)
        self._lib.paged_decode(
            _DTYPE_CODES[q.dtype],
            _DTYPE_CODES[kv_layer.dtype],
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

    def paged_prefill(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_table: torch.Tensor,
        num_computed_tokens: int,
        scale: float,
        num_threads: int = 1,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of one sequence's new tokens over its paged context, whose K/V
        (the new tokens' included) are already in the cache. q [num_new, num_heads, head_dim]
        (rows may be strided, each row's heads contiguous), kv_layer [2, num_blocks,
        block_size, num_kv_heads, head_dim], block_table [context blocks] int64 ->
        [num_new, num_heads * head_dim] in q's dtype (written into `out`, contiguous, where
        given), on up to `num_threads` threads (`prefill_threads`: as many as its work
        repays)."""
        num_new, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_layer.shape
        if not (
            kv_layer.is_contiguous()
            and block_table.is_contiguous()
            and block_table.dtype == torch.int64
        ):
            raise ValueError("the kernel needs a contiguous cache and an int64 block table")
        if head_dim % 16 or num_heads % num_kv_heads:
            raise ValueError("head_dim must be a multiple of 16 and heads a multiple of kv heads")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if out is None:
            out = empty_rows(num_new, num_heads * head_dim, q.dtype)
        elif not (
            out.is_contiguous()
            and out.dtype == q.dtype
            and out.shape == (num_new, num_heads * head_dim)
        ):
            raise ValueError(
                "out must be a contiguous [num_new, num_heads * head_dim] of q's dtype"
            )
        scratch = torch.empty(
            self._lib.prefill_scratch_bytes(
                head_dim, num_threads, num_kv_heads, num_computed_tokens + num_new
            ),
            dtype=torch.uint8,
        )
        self._lib.paged_prefill(
            _DTYPE_CODES[q.dtype],
            _DTYPE_CODES[kv_layer.dtype],
            q.data_ptr(),
            q.stride(0),
            kv_layer[0].data_ptr(),
            kv_layer[1].data_ptr(),
            block_table.data_ptr(),
            num_new,
            num_computed_tokens,
            out.data_ptr(),
            scratch.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            num_threads,
        )
        return out

    # ---- elementwise ----------------------------------------------------------------------
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual), x [rows, hidden]; `residual` is
        updated in place. With residual None: (rms_norm(x) * weight, x). Rows shared by
        torch's threads from a few dozen (`row_threads`)."""
        x = x.contiguous()
        rows, hidden = x.shape
        out = empty_rows(rows, hidden, x.dtype)
        self._lib.add_rms_norm(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            (x if residual is None else residual).data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            residual is not None,
            torch.get_num_threads(),
        )
        return out, x if residual is None else residual

    def rotary_(
        self, x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate heads [0, num_heads) of every row of x [rows, >= num_heads * head_dim] (rows
        may be strided, each row contiguous) in place; cos/sin float32 [rows, head_dim/2].
        Rows shared by torch's threads from a few dozen (`row_threads`)."""
        if x.stride(1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rotary_ needs contiguous rows and contiguous cos/sin")
        self._lib.rotary(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            num_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2 * width] = [gate | up] -> [rows, width], rows
        shared by torch's threads from a few hundred (`silu_mul_threads`)."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = empty_rows(rows, width, gate_up.dtype)
        self._lib.silu_mul(
            _DTYPE_CODES[gate_up.dtype],
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            width,
            torch.get_num_threads(),
        )
        return out

    def fused_decoder(self, layers: list[DecoderLayerWeights], final_norm: torch.Tensor, **dims):
        """A `FusedDecoder` over these weights (dims: intermediate, num_heads, num_kv_heads,
        head_dim, eps, scale)."""
        return FusedDecoder(self._lib, layers, final_norm, **dims)

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
    ) -> bool:
        """k, v [T, num_kv_heads, head_dim] -> their slots of kv_layer [2, num_blocks,
        block_size, num_kv_heads, head_dim] (slot_mapping [T] int64, valid slots), rounded
        once to the cache's dtype; False (nothing written) unless k and v are views with
        each row's values contiguous and rows equally far apart (the qkv product's slices)."""
        width = k.shape[1] * k.shape[2]
        if not (
            kv_layer.is_contiguous()
            and slot_mapping.is_contiguous()
            and slot_mapping.dtype == torch.int64
            and k.dtype == v.dtype
            and k.stride() == v.stride()
            and k.stride()[1:] == (k.shape[2], 1)
        ):
            return False
        self._lib.write_kv_rows(
            _DTYPE_CODES[k.dtype],
            _DTYPE_CODES[kv_layer.dtype],
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            kv_layer[0].data_ptr(),
            kv_layer[1].data_ptr(),
            slot_mapping.data_ptr(),
            k.shape[0],
            width,
        )
        return True

    def stream_sum(self, values: torch.Tensor, num_threads: int = 1) -> float:
        """The sum of a contiguous float32 tensor of a multiple of 64 elements, read as one
        stream per thread (the memory-bandwidth probe)."""
        if values.dtype != torch.float32 or values.numel() % 64 or not values.is_contiguous():
            raise ValueError("stream_sum needs a contiguous float32 tensor of 64k elements")
        return self._lib.stream_sum(values.data_ptr(), values.numel(), num_threads)


class _PackedLinear(ctypes.Structure):
    _fields_ = (("format", _I), ("out", _I), ("in_", _I), ("data", _P), ("bias", _P))


class _DecoderLayer(ctypes.Structure):
    _fields_ = (
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _PackedLinear),
        ("o", _PackedLinear),
        ("gate_up", _PackedLinear),
        ("down", _PackedLinear),
    )


class _DecoderModel(ctypes.Structure):
    _fields_ = (
        *((name, _I) for name in ("num_layers", "hidden", "intermediate", "num_heads")),
        *((name, _I) for name in ("num_kv_heads", "head_dim", "dt", "kv_dt")),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("layers", ctypes.POINTER(_DecoderLayer)),
        ("final_norm", _P),
    )


# The structs passed to the library, in the order `pdserve_struct_sizes` reports their sizes.
_STRUCTS = (_PackedLinear, _DecoderLayer, _DecoderModel)


def check_struct_sizes(library: ctypes.CDLL) -> None:
    """Raise unless every ctypes mirror has its C struct's size (cpu_ops.c's own `sizeof`)."""
    sizes = (ctypes.c_int64 * len(_STRUCTS))()
    library.pdserve_struct_sizes(sizes)
    for struct, size in zip(_STRUCTS, sizes, strict=True):
        if ctypes.sizeof(struct) != size:
            raise RuntimeError(
                f"cpu_ops.py's {struct.__name__} is {ctypes.sizeof(struct)} bytes, "
                f"the C struct {size}: the mirror no longer matches cpu_ops.c"
            )


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer's tensors as `decode_forward` reads them (norm weights in the model dtype)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedWeight
    qkv_bias: torch.Tensor | None
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


class FusedDecoder:
    """The whole decoder stack for a batch of single-token sequences in one native call
    (`decode_forward` in cpu_ops.c): the same kernels in the same order as the per-op path,
    without Python between them. Holds references to every tensor it points at."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        *,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
    ) -> None:
        self._lib = lib
        self._tensors = (layers, final_norm)
        self._layers = (_DecoderLayer * len(layers))(
            *(
                _DecoderLayer(
                    w.input_norm.data_ptr(),
                    w.post_norm.data_ptr(),
                    _linear_struct(w.qkv, w.qkv_bias),
                    _linear_struct(w.o, None),
                    _linear_struct(w.gate_up, None),
                    _linear_struct(w.down, None),
                )
                for w in layers
            )
        )
        self.dtype = final_norm.dtype
        self._model = _DecoderModel(
            len(layers),
            final_norm.shape[0],
            intermediate,
            num_heads,
            num_kv_heads,
            head_dim,
            _DTYPE_CODES[self.dtype],
            0,
            eps,
            scale,
            self._layers,
            final_norm.data_ptr(),
        )
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [rows, hidden] (the embeddings; overwritten) -> final-normed states, row r
        being sequence r; cos/sin float32 [rows, head_dim / 2]; kv_cache [num_layers, 2,
        num_blocks, block_size, num_kv_heads, head_dim] (receives the new K/V at
        slot_mapping [rows] int64); block_tables [rows, max_blocks], seq_lens [rows] int64.
        Runs on torch's thread count; the result does not depend on it."""
        if not (hidden.is_contiguous() and kv_cache.is_contiguous() and cos.is_contiguous()):
            raise ValueError("decode_forward needs contiguous hidden states, angles and cache")
        rows, num_threads = hidden.shape[0], torch.get_num_threads()
        self._model.kv_dt = _DTYPE_CODES[kv_cache.dtype]
        needed = self._lib.decode_scratch_bytes(ctypes.byref(self._model), rows, num_threads)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.uint8)
        self._lib.decode_forward(
            ctypes.byref(self._model),
            rows,
            hidden.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kv_cache.data_ptr(),
            kv_cache.shape[2],
            kv_cache.shape[3],
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.shape[1],
            self._scratch.data_ptr(),
            num_threads,
        )
        return hidden


def _linear_struct(weight: PackedWeight, bias: torch.Tensor | None) -> _PackedLinear:
    return _PackedLinear(
        weight.format,
        weight.out_features,
        weight.in_features,
        weight.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
    )


@functools.cache
def dpbf16_choice(ops: CpuOps) -> MeasuredChoice:
    """Whether bf16 dot products for every row count (A) beat them for one or two rows only
    (B), timed on a bf16 linear of a full tile of rows and cached with the kernels."""

    def prepare(case: tuple) -> tuple:
        _, rows = case
        generator = torch.Generator().manual_seed(0)
        weight = ops.pack_dense(torch.randn(4096, 1024, generator=generator).bfloat16())
        x = torch.randn(rows, 1024, generator=generator).bfloat16()

        def run(max_rows: int) -> torch.Tensor:
            ops.set_dpbf16_max_rows(max_rows)
            return ops.linear(x, weight, None)

        return functools.partial(run, DPBF16_ALL_ROWS), functools.partial(run, DPBF16_FEW_ROWS)

    return MeasuredChoice(f"linear-dpbf16-{ops.isa}", ops.build_id, prepare, kernels_cache_dir())


@functools.cache
def kv_prefetch_choice(ops: CpuOps) -> MeasuredChoice:
    """Whether decode attention prefetching its KV into L1 (A) beats into L2 (B), timed over
    KV_PREFETCH_LAYERS layers' caches of scattered blocks (its KV streamed from memory, as a
    decode step's is) and cached with the kernels."""

    def prepare(case: tuple) -> tuple:
        _, num_seqs = case
        num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
        num_blocks = num_seqs * KV_PREFETCH_CONTEXT // block_size
        generator = torch.Generator().manual_seed(0)
        caches = [
            torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
            for _ in range(KV_PREFETCH_LAYERS)
        ]
        tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, -1).contiguous()
        seq_lens = torch.full((num_seqs,), KV_PREFETCH_CONTEXT, dtype=torch.int64)
        q = torch.randn(num_seqs, num_heads, head_dim, generator=generator).bfloat16()

        def run(is_l1: bool) -> None:
            ops.set_kv_prefetch_into_l1(is_l1)
            for cache in caches:
                ops.paged_decode(q, cache, tables, seq_lens, head_dim**-0.5)

        return functools.partial(run, True), functools.partial(run, False)

    return MeasuredChoice(f"kv-prefetch-{ops.isa}", ops.build_id, prepare, kernels_cache_dir())


def requested_isa() -> str | None:
    """The variant `PDSERVE_CPU_ISA` names (None: choose from the CPU's flags)."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    return name or None


@functools.cache
def load_cpu_ops(isa: str | None = None) -> CpuOps | None:
    """The kernels for variant `isa` (default: `PDSERVE_CPU_ISA`, else the best this CPU
    runs), compiled on first use; None without a C compiler. A named variant this CPU cannot
    run raises ValueError."""
    isa = isa or requested_isa()
    if isa is not None:
        chosen = variant(isa)
        if not can_run(chosen):
            raise ValueError(
                f"this CPU cannot run the {isa} kernels ({ISA_ENV} or isa=...; it runs: "
                f"{', '.join(v.name for v in runnable_variants())})"
            )
        candidates = (chosen,)
    else:
        candidates = runnable_variants()
    for candidate in candidates:
        library = load_library(SOURCE, candidate)
        if library is not None:
            logger.debug("CPU kernels: %s", candidate.name)
            ops = CpuOps(library, candidate.name)
            ops.tune_bf16_dot()
            ops.tune_kv_prefetch()
            return ops
    return None


__all__ = ["VARIANT_NAMES", "CpuOps", "PackedWeight", "WeightFormat", "load_cpu_ops"]
