"""Building blocks of the decoder: linear layers, RMSNorm, rotary position embeddings.

All weights are [out_features, in_features] (Hugging Face layout), so a linear layer is a
GEMV/GEMM against the rows of W, which streams weights at memory speed.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.config import ModelConfig, Quantization, RopeScaling
from pdserve.model.kernels.choice import ROUNDS, MeasuredChoice, kernels_cache_dir, size_bucket
from pdserve.model.kernels.cpu_ops import (
    CpuOps,
    PackedWeight,
    WeightFormat,
    empty_rows,
    onednn_rows,
)
from pdserve.model.quant import QuantizedWeight, quantize_int8

logger = logging.getLogger(__name__)

# Distinct weights a linear's measured choice cycles through: each timed run (ROUNDS after a
# warm-up) reads weights no earlier run of that path read.
COLD_WEIGHTS = ROUNDS + 1


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features].

    `load()` takes the weight as floats or as a `QuantizedWeight` (GGUF blocks); `pack()` then
    puts it in the fastest layout for this device:
    - CPU kernels (`CpuOps.linear`): W streamed once per call in groups of 16 output rows, for
      any number of input rows; quantized weights (GGUF blocks, `--quantization int8`) always
      run there, and dense ones up to `kernel_max_rows` rows (decode batches).
    - oneDNN's blocked layout for dense weights beyond that (prefill GEMMs, where oneDNN's
      AMX / bf16 kernels win); it doubles the dense weights' memory.
    - elsewhere (CUDA, no compiler) `F.linear`; quantized weights are then dequantized to the
      model dtype at load, the same values without the savings.
    """

    # Rows of x the blocked layout is tuned for; any row count works with either layout.
    PACK_BATCH_HINT = 32

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        ops: CpuOps | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.ops = ops
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        # Set by `load` in place of `weight` when the checkpoint's blocks are kept.
        self.quantized: QuantizedWeight | None = None
        # W in a `CpuOps.linear` format, used for inputs of up to `kernel_max_rows` rows
        # (None: any number), else None.
        self.kernel_weight: PackedWeight | None = None
        self.kernel_max_rows: int | None = None
        # The oneDNN-blocked copy of a dense `weight` (then `weight` is dropped), or None.
        self.onednn_weight: torch.Tensor | None = None

    @property
    def uses_kernel(self) -> bool:
        return self.ops is not None and self.weight is not None and self.weight.device.type == "cpu"

    def load(self, weight: torch.Tensor | QuantizedWeight) -> None:
        """Fill W from floats [out, in] or quantized blocks (kept only where the CPU kernels
        run; dequantized otherwise)."""
        if not isinstance(weight, QuantizedWeight):
            self.weight.copy_(weight)
        elif self.uses_kernel:
            self.quantized = weight
        else:
            self.weight.copy_(weight.dequantize())

    def pack(self, quantization: Quantization = Quantization.NONE) -> None:
        """Switch to the fastest kernels for this device; a no-op off CPU."""
        if self.weight is None or self.weight.device.type != "cpu":
            return
        if self.quantized is None and quantization is Quantization.INT8:
            self.quantized = quantize_int8(self.weight)
            if not self.uses_kernel:  # no kernels: the int8 values, computed in floats
                self.weight.copy_(self.quantized.dequantize())
                self.quantized = None
        if self.quantized is not None:
            self.kernel_weight = self.quantized.pack()
            self.quantized = self.weight = None
            return
        if self.ops is not None and CpuOps.can_pack(self.weight):
            self.kernel_weight = self.ops.pack_dense(self.weight)
            self.kernel_max_rows = self.ops.dense_kernel_max_rows(self.weight.dtype)
            if self.kernel_max_rows is None:
                self.weight = None
                return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, self.PACK_BATCH_HINT)
            probe = torch.zeros(1, self.in_features, dtype=self.weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
        except (AttributeError, RuntimeError) as e:  # no oneDNN in this torch build
            logger.debug("oneDNN linear unavailable, using F.linear: %s", e)
            return
        self.onednn_weight = packed
        self.weight = None

    @property
    def weight_nbytes(self) -> int:
        """Bytes one pass over W reads in the layout a decode step uses."""
        if self.kernel_weight is not None:
            return self.kernel_weight.nbytes
        weight = self.weight if self.weight is not None else self.onednn_weight
        return weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is not None and (
            self.kernel_max_rows is None
            or x.shape[0] <= self.kernel_max_rows
            or self._kernel_wins(x.shape[0])
        ):
            return self.ops.linear(x, self.kernel_weight, self.bias)
        if self.onednn_weight is not None:
            return onednn_linear(x, self.onednn_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _kernel_wins(self, rows: int) -> bool:
        """Whether the kernels beat oneDNN on `rows` rows of bfloat16 weights kept in both
        layouts, as measured here (`bf16_linear_choice`; oneDNN until measured)."""
        return (
            self.kernel_weight.format == WeightFormat.BF16
            and self.onednn_weight is not None
            and bf16_linear_choice(self.ops).a_wins_or(
                bf16_linear_case(self.out_features, self.in_features, rows), default=False
            )
        )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] W^T (+ bias) by oneDNN on its blocked `weight`; an x from `empty_rows`
    runs its padded row count (one primitive per bucket, not per row count)."""
    rows, padded = x.shape[0], onednn_rows(x.shape[0])
    if padded != rows and _has_room(x, padded):
        x = x.as_strided((padded, x.shape[1]), (x.shape[1], 1))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def bf16_linear_case(out_features: int, in_features: int, rows: int) -> tuple:
    """The case `bf16_linear_choice` measures a linear as: its shape, torch's threads and its
    rows rounded up to a power of two."""
    return (out_features, in_features, torch.get_num_threads(), size_bucket(rows))


@functools.cache
def bf16_linear_choice(ops: CpuOps) -> MeasuredChoice:
    """Whether `CpuOps.linear` (A) beats oneDNN (B) on bfloat16 weights past the kernels' own
    rows, per `bf16_linear_case`, measured on this machine (`measure_linear_choices`) and
    cached next to the compiled kernels. On one Sapphire Rapids core, weights from memory
    (`_bf16_linear_paths`), the AMX kernels won SmolLM2's 576 x 576 at 128 and 256 rows and
    576 x 1,536 at 128 (they run a step's exact rows where oneDNN pads), oneDNN the rest."""
    return MeasuredChoice(
        f"linear-bf16-cold-{ops.isa}",  # "cold": measured as COLD_WEIGHTS says
        ops.build_id,
        functools.partial(_bf16_linear_paths, ops),
        kernels_cache_dir(),
        num_size_fields=1,  # rows
    )


def _bf16_linear_paths(ops: CpuOps, case: tuple) -> tuple[Callable[[], object], ...]:
    """(kernels, oneDNN) runs of a bfloat16 linear of `case`'s shape on its threads, x from
    `empty_rows` as the model's activations are, of a row count within the case's bucket
    that oneDNN pads (as a step's total mostly is), not the bucket's own. Each run takes the
    next of `COLD_WEIGHTS` weights, as a model's successive layers read weights that are not
    in the core's caches: with one weight read again, the kernels won cases (2 Sapphire
    Rapids vCPUs: 960 x 576 at 128 and 256 rows) that oneDNN won by 16-22% on weights from
    memory."""
    out_features, in_features, threads, bucket = case
    rows = bucket * 3 // 4 + 1
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(out_features, in_features, generator=generator).bfloat16()
        for _ in range(COLD_WEIGHTS)
    ]
    packed = itertools.cycle([ops.pack_dense(weight) for weight in weights])
    blocked = itertools.cycle(
        [torch.ops.mkldnn._reorder_linear_weight(w, Linear.PACK_BATCH_HINT) for w in weights]
    )
    x = empty_rows(rows, in_features, torch.bfloat16)
    x.copy_(torch.randn(rows, in_features, generator=generator))

    def on_threads(run: Callable[[], object]) -> Callable[[], object]:
        def timed() -> object:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return run()
            finally:
                torch.set_num_threads(previous)

        return timed

    return (
        on_threads(lambda: ops.linear(x, next(packed), None)),
        on_threads(lambda: onednn_linear(x, next(blocked), None)),
    )


def measure_linear_choices(linears: list[Linear], max_num_new: int, budget_s: float) -> None:
    """Measure (within `budget_s`) `bf16_linear_choice` for those of `linears` that keep
    bfloat16 weights in both layouts, at every power of two of rows past the kernels' own up
    to `max_num_new`, on torch's threads; log what was chosen."""
    linears = [
        linear
        for linear in linears
        if linear.kernel_weight is not None
        and linear.kernel_weight.format == WeightFormat.BF16
        and linear.onednn_weight is not None
        and linear.kernel_max_rows is not None
    ]
    if not linears:
        return
    ops = linears[0].ops
    shapes = sorted({(linear.out_features, linear.in_features) for linear in linears})
    first = size_bucket(linears[0].kernel_max_rows + 1)
    last = size_bucket(max(max_num_new, first))
    buckets = [rows for rows in (first * 2**i for i in range(16)) if rows <= last]
    cases = [bf16_linear_case(out, inp, rows) for rows in buckets for out, inp in shapes]
    choice = bf16_linear_choice(ops)
    choice.measure(cases, budget_s)
    wins = [case for case in cases if choice.a_wins_or(case, default=False)]
    logger.info(
        "bf16 linears past %d rows, %d thread(s): the kernels on %s, oneDNN on the other %d "
        "of %d cases (out x in @ rows, measured here)",
        linears[0].kernel_max_rows,
        torch.get_num_threads(),
        " ".join(f"{c[0]}x{c[1]}@{c[3]}" for c in wins) or "none",
        len(cases) - len(wins),
        len(cases),
    )


def _has_room(x: torch.Tensor, rows: int) -> bool:
    """Whether x [n, cols] is the start of a contiguous buffer of at least `rows` rows."""
    return (
        x.is_contiguous()
        and x.storage_offset() == 0
        and x.untyped_storage().nbytes() >= rows * x.shape[1] * x.element_size()
    )


class RMSNorm(nn.Module):
    """Adds the residual stream, then normalises: h / rms(h) * weight (in float32, cast back).

    With `ops` (CPU kernels) both happen in one pass and the residual is updated in place.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        ops: CpuOps | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (normed x + residual, x + residual); residual None
        means the stream starts at x."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x if residual is None else x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" convention of Hugging Face checkpoints:
    dimension i of a head pairs with dimension i + head_dim/2.

    `angles(positions)` runs once per forward; `rotate(qkv, ...)` once per layer.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        ops: CpuOps | None = None,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.head_dim = config.head_dim
        self.ops = ops
        inv_freq = _inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token rotation for positions [T], computed in float32: for the CPU kernel
        (cos, sin) [T, head_dim/2]; else (cos, signed sin) [T, 1, head_dim] in the model dtype,
        the sin of the first half negated so that `rotate` is three ops."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.ops is not None:
            return cos, sin
        return (
            torch.cat((cos, cos), dim=-1).to(self.dtype)[:, None, :],
            torch.cat((-sin, sin), dim=-1).to(self.dtype)[:, None, :],
        )

    def rotate(
        self, qkv: torch.Tensor, num_heads: int, angles: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """The first `num_heads` heads of each row of qkv [T, >= num_heads * head_dim] (the
        fused q and k), rotated: [T, num_heads, head_dim]. The CPU kernel rotates in place."""
        num_tokens = qkv.shape[0]
        if self.ops is not None:
            self.ops.rotary_(qkv, num_heads, self.head_dim, *angles)
            return qkv[:, : num_heads * self.head_dim].view(num_tokens, num_heads, self.head_dim)
        x = qkv[:, : num_heads * self.head_dim].view(num_tokens, num_heads, self.head_dim)
        cos, signed_sin = angles
        x1, x2 = x.chunk(2, dim=-1)
        # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1) = (x2, x1) * sign
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused gate/up projection output [T, 2 * intermediate]."""

    def __init__(self, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    )
    if scaling is None:
        return inv_freq
    # Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed
    # by `factor`, shorter than original / high_freq_factor kept, and blended in between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
