"""`--dtype auto` on CPU: bfloat16 or float32, whichever runs this CPU's linears faster.

Decode streams the weights, so half the bytes helps even without bf16 dot products; prefill
multiplies, where bfloat16 wins only with bf16 matrix instructions (or a kernel that widens
it in registers at float32's speed). Which way the sum goes is a property of the CPU, so it
is measured: the same `Linear` layers the model uses (kernels or oneDNN, as `pack()` picks),
in both dtypes, run for one decode row and one prefill chunk; the faster dtype wins. Measured
once per machine (kernel build, CPU model, torch version) and cached with the kernels.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.model.kernels.choice import MeasuredChoice, kernels_cache_dir
from pdserve.model.kernels.cpu_ops import load_cpu_ops
from pdserve.model.layers import Linear

logger = logging.getLogger(__name__)

# The probe: NUM_LAYERS square linears (32 MiB of float32 weights in all), driven by one
# decode row and by a PREFILL_ROWS-row chunk, timed as one run.
HIDDEN, NUM_LAYERS, PREFILL_ROWS = 1024, 8, 128
CASE = ("linear", HIDDEN, NUM_LAYERS, PREFILL_ROWS)


def _probe(dtype: torch.dtype):
    ops = load_cpu_ops()
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(NUM_LAYERS):
        layer = Linear(HIDDEN, HIDDEN, False, dtype, torch.device("cpu"), ops)
        layer.load(torch.randn(HIDDEN, HIDDEN, generator=generator) * HIDDEN**-0.5)
        layer.pack()
        layers.append(layer)
    rows = (torch.randn(1, HIDDEN).to(dtype), torch.randn(PREFILL_ROWS, HIDDEN).to(dtype))

    @torch.inference_mode()
    def run():
        for x in rows:
            for layer in layers:
                x = layer(x)

    return run


@functools.cache
def dtype_choice() -> MeasuredChoice:
    """Whether bfloat16 (A) beats float32 (B) on the probe, measured here once."""
    ops = load_cpu_ops()
    return MeasuredChoice(
        "auto-dtype",
        "torch" if ops is None else ops.build_id,
        lambda case: (_probe(torch.bfloat16), _probe(torch.float32)),
        kernels_cache_dir(),
    )


def measured_cpu_dtype() -> torch.dtype:
    """The dtype `auto` means on this CPU (logged with the timings behind it)."""
    choice = dtype_choice()
    dtype = torch.bfloat16 if choice.a_wins(CASE) else torch.float32
    bf16_s, fp32_s = choice.timing(CASE)
    logger.info(
        "dtype auto: %s on this CPU (linears measured here: bfloat16 %.1f ms, float32 %.1f ms)",
        str(dtype).removeprefix("torch."),
        bf16_s * 1e3,
        fp32_s * 1e3,
    )
    return dtype
