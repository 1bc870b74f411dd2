"""Weight quantization: GGUF blocks kept as they are, and int8 computed at load.

`QuantizedWeight` is a [rows, cols] matrix in one of the formats the CPU kernels multiply
without dequantizing (`cpu_ops.c`, W_*): GGUF's Q8_0, Q4_0 and Q4_1 (blocks of 32 values along
a row, each with an fp16 scale and, for Q4_1, an fp16 minimum; multiplied by integer dot
products with the activations quantized per block, as llama.cpp does) and INT8, weight-only
(symmetric int8 with a scale per output channel and block of 32 inputs, computed at load from
any checkpoint; activations keep their precision: floats, or 16-bit integers per block in AMX
tiles, below). It converts to the kernels' packed layout
(`pack`) and back to floats (`dequantize`: the reference, and the fallback where the kernels
do not run, e.g. on CUDA).

Why not one scale per output channel: on the default model (whose weights come from 4-bit
blocks, with scales that vary along each row) that agrees with float32 on 95.5% of greedy
tokens over a 2,048-token text, against 97.7% with a scale per 32 inputs; quantizing the
activations too costs another ~4 points, so INT8 keeps them in floats. Where the CPU has AMX
tiles (the `amx` kernels), up to 16 rows multiply the int8 weights as they are in integer tiles,
x quantized to 16 bits per block of 32 (`SPLIT_X_LEVELS`, two int8 tiles; its error far below
bfloat16's rounding), so a decode step reads each weight byte once without converting it; more
rows multiply there with x and each dequantized weight rounded to bfloat16 (97.9% agreement on
that text, perplexity +0.2%): a prefill chunk then costs what the weights' bytes do, not rows
of float FMAs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.model.kernels.cpu_ops import PackedWeight, WeightFormat

BLOCK = 32  # values per quantization block, along the input dimension


class QuantType(enum.Enum):
    """Stored block formats: (GGUF block bytes, kernel format)."""

    Q8_0 = (34, WeightFormat.Q8_0)
    Q4_0 = (18, WeightFormat.Q4_0)
    Q4_1 = (20, WeightFormat.Q4_1)
    INT8 = (None, WeightFormat.INT8)

    @property
    def block_bytes(self) -> int | None:
        return self.value[0]

    @property
    def kernel_format(self) -> int:
        return self.value[1]

    @property
    def quantizes_activations(self) -> bool:
        """Whether the kernels quantize x per block to int8 (`quantize_activations`) to
        multiply integers; INT8 is weight-only (x to 16 bits at most: `SPLIT_X_LEVELS`)."""
        return self is not QuantType.INT8


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight in `qtype`. GGUF types: `data` uint8 [rows, cols / 32 *
    block_bytes] (the file's bytes, rows in Hugging Face order); INT8: `data` int8 [rows, cols]
    and `scales` float32 [rows, cols / 32] (each exactly an fp16 value)."""

    qtype: QuantType
    data: np.ndarray
    shape: tuple[int, int]
    scales: np.ndarray | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if cols % BLOCK:
            raise ValueError(f"quantized weights need a multiple of {BLOCK} columns, got {cols}")
        width = cols if self.qtype is QuantType.INT8 else cols // BLOCK * self.qtype.block_bytes
        if self.data.shape != (rows, width):
            raise ValueError(f"{self.qtype.name} data {self.data.shape} != {(rows, width)}")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The rows of `parts` stacked (a fused projection); None unless they share one type
        and column count."""
        first = parts[0]
        if any(p.qtype is not first.qtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        scales = None if first.scales is None else np.concatenate([p.scales for p in parts])
        rows = sum(p.shape[0] for p in parts)
        data = np.concatenate([p.data for p in parts])
        return QuantizedWeight(first.qtype, data, (rows, first.shape[1]), scales)

    def is_finite(self) -> bool:
        """Whether every scale (and min) is finite, i.e. every value is."""
        if self.scales is not None:
            return bool(np.isfinite(self.scales).all())
        _, scales, mins = self._fields()
        return bool(np.isfinite(scales).all() and (mins is None or np.isfinite(mins).all()))

    def permute_rows(self, order: np.ndarray | slice) -> QuantizedWeight:
        scales = None if self.scales is None else self.scales[order]
        return QuantizedWeight(self.qtype, self.data[order], self.shape, scales)

    # ---- values -----------------------------------------------------------------------
    def _fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(integers [rows, cols] as stored, scales [rows, blocks], mins [rows, blocks] or
        None) of a GGUF type."""
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // BLOCK, self.qtype.block_bytes)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        if self.qtype is QuantType.Q8_0:
            return blocks[..., 2:].view(np.int8).reshape(rows, cols), scales, None
        header = 4 if self.qtype is QuantType.Q4_1 else 2
        packed = blocks[..., header:]  # byte j: value j (low nibble), value j + 16 (high)
        values = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)
        mins = None
        if self.qtype is QuantType.Q4_1:
            mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return values, scales, mins

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: what the stored values mean."""
        rows, cols = self.shape
        if self.qtype is QuantType.INT8:
            blocks = self.data.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
            return torch.from_numpy((blocks * self.scales[..., None]).reshape(rows, cols))
        values, scales, mins = self._fields()
        if self.qtype is QuantType.Q4_0:
            values = values.astype(np.int16) - 8
        out = values.reshape(rows, cols // BLOCK, BLOCK) * scales[..., None]
        if mins is not None:
            out = out + mins[..., None]
        return torch.from_numpy(out.reshape(rows, cols).astype(np.float32))

    # ---- the kernels' layout ----------------------------------------------------------
    def pack(self) -> PackedWeight:
        """The layout `cpu_ops.c` streams: per group of 16 rows (zero-padded) and block of 32
        inputs, the group's scales (and mins), then its integers."""
        rows, cols = self.shape
        groups, nb = -(-rows // 16), cols // BLOCK
        if self.qtype is QuantType.INT8:
            values, scales, mins = self.data, self.scales, None
        else:
            values, scales, mins = self._fields()
        values = _pad_rows(values, groups * 16).reshape(groups, 16, nb, 8, 4)
        if self.qtype is QuantType.INT8:
            # [32 inputs][16 rows] int8: one row-vector per input.
            ints = values.transpose(0, 2, 3, 4, 1).reshape(groups, nb, 512).view(np.uint8)
        elif self.qtype is QuantType.Q8_0:
            # Stored + 128, in quads of 4 inputs: [16 rows][4 inputs] per 64 bytes.
            biased = (values.astype(np.int16) + 128).astype(np.uint8)
            ints = biased.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 512)
        else:
            # A quad's byte j: row j / 4 (low nibble) and row 8 + j / 4 (high), input j % 4.
            nibbles = values.reshape(groups, 2, 8, nb, 8, 4).transpose(0, 3, 4, 1, 2, 5)
            ints = (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).reshape(groups, nb, 256)
        headers = [
            np.ascontiguousarray(
                _pad_rows(f, groups * 16).reshape(groups, 16, nb).transpose(0, 2, 1)
            )
            .astype(np.float16)
            .view(np.uint8)
            for f in ([scales] if mins is None else [scales, mins])
        ]
        packed = np.concatenate((*headers, np.ascontiguousarray(ints)), axis=2)
        data = torch.from_numpy(packed.reshape(groups, -1))
        return PackedWeight(self.qtype.kernel_format, data, rows, cols)


def _pad_rows(values: np.ndarray, rows: int) -> np.ndarray:
    if values.shape[0] == rows:
        return values
    padded = np.zeros((rows, *values.shape[1:]), dtype=values.dtype)
    padded[: values.shape[0]] = values
    return padded


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output row and block of 32 inputs: scale = max |w| / 127 (rounded to
    fp16, as stored), q = round(w / scale)."""
    rows, cols = weight.shape
    blocks = weight.detach().float().cpu().reshape(rows, cols // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / 127.0).half().float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(
        QuantType.INT8, q.reshape(rows, cols).numpy(), (rows, cols), scales.numpy()
    )


# INT8 weights meet x quantized to these levels in AMX integer tiles (`CpuOps.split_x_max_rows`;
# cpu_ops.c's SPLIT_X_LEVELS).
SPLIT_X_LEVELS = 32767


def quantize_activations(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """What the kernels do to x [rows, cols] before the integer dot products: per block of 32,
    q = round(x * levels / amax), then x' = q * amax / levels (the reference for tests)."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q * (amax / levels)).reshape(rows, cols)
