"""The fused CPU kernels equal the torch ops they replace, in every ISA variant this CPU runs
(AVX-512 with and without bf16/VNNI, AVX2, portable C): each variant is its own library."""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import signal
import time

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import quantize

from pdserve.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    prefill_case,
    prefill_kernel_choice,
)
from pdserve.model.cpu_runtime import ONEDNN_CACHE_CAPACITY
from pdserve.model.kernels import cpu_ops
from pdserve.model.kernels.build import VARIANTS, can_run
from pdserve.model.kernels.cpu_ops import CpuOps, empty_rows, load_cpu_ops, onednn_rows
from pdserve.model.layers import (
    Linear,
    bf16_linear_case,
    bf16_linear_choice,
    measure_linear_choices,
)
from pdserve.model.quant import (
    SPLIT_X_LEVELS,
    QuantizedWeight,
    QuantType,
    quantize_activations,
    quantize_int8,
)
from tests.model.helpers import kernel_variants, require_kernels

HEADS = [(9, 3, 64), (4, 4, 128), (8, 1, 32)]  # (query heads, KV heads, head_dim)
DTYPES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(scope="module", params=kernel_variants())
def ops(request) -> CpuOps:
    ops = require_kernels(load_cpu_ops(request.param), request.param)
    assert ops.isa == request.param
    return ops


def _tables(lengths, block_size, num_blocks, generator):
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(physical[:blocks])
        physical = physical[blocks:]
    return tables


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "atol"),
    [
        (torch.float32, torch.float32, 2e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float32, torch.bfloat16, 2e-5),  # a bf16 KV cache under a float32 model
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_paged_decode_matches_torch_path(
    ops, dtype, kv_dtype, atol, num_heads, num_kv_heads, head_dim, block_size
):
    generator = torch.Generator().manual_seed(0)
    num_blocks = 1280 // block_size
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
        kv_dtype
    )
    lengths = [1, 16, 17, 300, 45, 33]
    tables = _tables(lengths, block_size, num_blocks, generator)
    meta = AttentionMetadata.build(
        [(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)], block_size, "cpu"
    )
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend(scale)._decode(q, cache, meta.decode, None)
    got = ops.paged_decode(q, cache, meta.decode.block_tables, meta.decode.seq_lens, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


def _prefill_reference(q, cache, table, num_computed, scale):
    """Float64 causal attention of q [new, heads, D] over the first num_computed + new
    positions of the paged cache, gathered by the block table."""
    seq_len = num_computed + q.shape[0]
    num_kv_heads, head_dim = cache.shape[-2:]
    context = cache.index_select(1, table).view(2, -1, num_kv_heads, head_dim)[:, :seq_len]
    k, v = (x.double().transpose(0, 1)[None] for x in context)
    mask = torch.arange(seq_len)[None, :] <= torch.arange(num_computed, seq_len)[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "atol"),
    [
        (torch.float32, torch.float32, 2e-6),
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float32, torch.bfloat16, 2e-6),  # a bf16 KV cache under a float32 model
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [*HEADS, (2, 2, 16)])
@pytest.mark.parametrize(
    ("block_size", "num_computed", "num_new", "num_threads"),
    [
        (16, 0, 1, 1),
        (16, 0, 77, 1),  # one-shot: causal within the chunk, partial tiles and units
        (16, 500, 256, 1),  # a chunk over a long cached context
        (8, 41, 30, 3),  # units cut by small blocks
        (8, 3000, 30, 3),  # a team (enough scores), more members than some heads' blocks
        (32, 2000, 64, 2),
        (5, 13, 19, 2),  # a block size that is no multiple of the unit
    ],
)
def test_paged_prefill_matches_reference(
    ops,
    dtype,
    kv_dtype,
    atol,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    num_computed,
    num_new,
    num_threads,
):
    generator = torch.Generator().manual_seed(7)
    seq_len = num_computed + num_new
    num_blocks = -(-seq_len // block_size) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    cache = cache.to(kv_dtype)
    table = torch.randperm(num_blocks, generator=generator)[: -(-seq_len // block_size)]
    # q as the model passes it: rows of a fused qkv projection (strided between tokens).
    qkv = torch.randn(num_new, (num_heads + 2) * head_dim, generator=generator).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_new, num_heads, head_dim)
    scale = head_dim**-0.5
    got = ops.paged_prefill(q, cache, table, num_computed, scale, num_threads)
    assert got.dtype == dtype and got.shape == (num_new, num_heads * head_dim)
    expected = _prefill_reference(q, cache, table, num_computed, scale)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)


def test_paged_prefill_starts_members_only_for_work_that_repays_them(ops):
    assert ops._lib.prefill_threads(64, 0, 9, 3, 2) == 1  # one short prompt of a burst
    assert ops._lib.prefill_threads(2048, 0, 9, 3, 2) == 2
    assert ops._lib.prefill_threads(30, 3000, 9, 3, 3) == 3
    assert ops._lib.prefill_threads(30, 100_000, 9, 3, 64) == 6  # a member per block at most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_writes_into_out_the_same_on_any_thread_count(ops, dtype):
    generator = torch.Generator().manual_seed(8)
    num_computed, num_new, block_size = 1500, 200, 16
    num_blocks = -(-(num_computed + num_new) // block_size)
    cache = torch.randn(2, num_blocks, block_size, 3, 64, generator=generator).to(dtype)
    table = torch.randperm(num_blocks, generator=generator)
    q = torch.randn(num_new, 9, 64, generator=generator).to(dtype)
    alone = ops.paged_prefill(q, cache, table, num_computed, 0.125, 1)
    batch = torch.full((num_new + 10, 9 * 64), float("nan"), dtype=dtype)
    assert ops._lib.prefill_threads(num_new, num_computed, 9, 3, 2) == 2
    shared = ops.paged_prefill(q, cache, table, num_computed, 0.125, 2, out=batch[5:-5])
    assert shared.data_ptr() == batch[5].data_ptr()
    torch.testing.assert_close(batch[5:-5], alone, atol=0, rtol=0)
    assert batch[:5].isnan().all() and batch[-5:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        ops.paged_prefill(q, cache, table, num_computed, 0.125, 1, out=batch[:num_new, :64])


# float32: scores up to ~50 carry ~1e-5 of rounding into the weights.
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_paged_prefill_follows_scores_that_keep_growing(ops, dtype, atol):
    """Scores rising along the context move every row's running max again and again (the
    kernels rescale what they accumulated), and span far more than exp's float range."""
    generator = torch.Generator().manual_seed(9)
    num_computed, num_new, block_size = 200, 60, 16
    seq_len = num_computed + num_new
    direction = torch.randn(64, generator=generator)
    k = torch.randn(seq_len, 3, 64, generator=generator) + direction * torch.linspace(
        -3, 6, seq_len
    ).view(-1, 1, 1)
    v = torch.randn(seq_len, 3, 64, generator=generator)
    num_blocks = -(-seq_len // block_size)
    cache = torch.zeros(2, num_blocks * block_size, 3, 64)
    cache[0, :seq_len], cache[1, :seq_len] = k, v
    cache = cache.view(2, num_blocks, block_size, 3, 64).to(dtype)
    table = torch.arange(num_blocks)
    q = (direction + 0.3 * torch.randn(num_new, 9, 64, generator=generator)).to(dtype)
    got = ops.paged_prefill(q, cache, table, num_computed, 64**-0.5)
    expected = _prefill_reference(q, cache, table, num_computed, 64**-0.5)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_runs_where_the_choice_says(ops, monkeypatch, dtype):
    """The backend sends prefill chunks to the kernel or to SDPA as the measured choice's
    timings for the chunk's case say, with the same result either way."""
    generator = torch.Generator().manual_seed(8)
    cache = torch.randn(2, 12, 16, 3, 64, generator=generator).to(dtype)
    meta = AttentionMetadata.build([([5, 2, 9, 0, 7], 40, 30)], 16, "cpu")
    q, k, v = (torch.randn(30, h, 64, generator=generator).to(dtype) for h in (9, 3, 3))
    calls = []
    kernel = ops.paged_prefill

    def spy(*args, **kwargs):
        calls.append(args)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_prefill", spy)
    backend = TorchAttentionBackend(64**-0.5, ops)
    outputs = {}
    case = json.dumps(prefill_case(dtype, dtype, 9, 3, 64, 30, 40))
    for wins in (True, False):
        timing = (1.0, 2.0) if wins else (2.0, 1.0)  # (kernel, SDPA) seconds
        monkeypatch.setitem(prefill_kernel_choice(ops).timings, case, timing)
        calls.clear()
        outputs[wins] = backend.forward(q, k, v, cache.clone(), meta)
        assert len(calls) == int(wins)
    atol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outputs[True].float(), outputs[False].float(), atol=atol, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])  # 40: a partial last vector
def test_add_rms_norm(ops, dtype, atol, hidden):
    generator = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(5, hidden, generator=generator).to(dtype) for _ in range(2))
    weight = torch.rand(hidden, generator=generator).to(dtype) + 0.5
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual.float(), (hidden,), weight.float(), 1e-5)
    out, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual is residual  # updated in place
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)
    out, stream = ops.add_rms_norm(x, None, weight, 1e-5)
    assert stream is x
    torch.testing.assert_close(
        out.float(), F.rms_norm(x.float(), (hidden,), weight.float(), 1e-5), atol=atol, rtol=atol
    )


@pytest.mark.parametrize(("dtype", "atol"), DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_in_place(ops, dtype, atol, head_dim):
    generator = torch.Generator().manual_seed(2)
    num_tokens, num_rotated, num_heads = 7, 5, 6  # the last head (v) stays untouched
    qkv = torch.randn(num_tokens, num_heads * head_dim, generator=generator).to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=generator) * 10
    x = qkv.view(num_tokens, num_heads, head_dim).float()
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    expected[:, num_rotated:] = x[:, num_rotated:]
    ops.rotary_(qkv, num_rotated, head_dim, angles.cos(), angles.sin())
    torch.testing.assert_close(
        qkv.view(num_tokens, num_heads, head_dim).float(), expected, atol=atol, rtol=atol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_rows_shared_by_a_team_match_one_thread(ops, dtype):
    """1,000 rows split over 3 threads (rotary's strided, its cos/sin offset per share): the
    values one thread computes, bit for bit."""
    generator = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(1000, 576, generator=generator).to(dtype) for _ in range(2))
    weight = torch.rand(576, generator=generator).to(dtype) + 0.5
    qkv = torch.randn(1000, 15 * 64, generator=generator).to(dtype)
    angles = torch.rand(1000, 32, generator=generator) * 10
    results = {}
    previous = torch.get_num_threads()
    try:
        for num_threads in (1, 3):
            torch.set_num_threads(num_threads)
            stream = residual.clone()
            rotated = qkv.clone()
            ops.rotary_(rotated, 12, 64, angles.cos(), angles.sin())
            results[num_threads] = (*ops.add_rms_norm(x, stream, weight, 1e-5), rotated)
    finally:
        torch.set_num_threads(previous)
    for shared, alone in zip(results[3], results[1], strict=True):
        torch.testing.assert_close(shared, alone, atol=0, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), DTYPES)
@pytest.mark.parametrize("rows", [3, 1000])  # 1000: rows shared by a team
def test_silu_mul(ops, dtype, atol, rows):
    generator = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(rows, 2 * 200, generator=generator) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.silu_mul(gate_up)
        torch.set_num_threads(3)
        shared = ops.silu_mul(gate_up)
    finally:
        torch.set_num_threads(previous)
    assert ops._lib.silu_mul_threads(rows, 3) == (1 if rows < 768 else 2)
    torch.testing.assert_close(alone.float(), F.silu(gate) * up, atol=atol, rtol=atol)
    torch.testing.assert_close(shared, alone, atol=0, rtol=0)


ROWS = [1, 2, 3, 5, 8, 13, 40]  # every row tile, with partial tiles


@pytest.fixture(params=[cpu_ops.DPBF16_FEW_ROWS, cpu_ops.DPBF16_ALL_ROWS])
def dpbf16_rows(ops, request):
    """bfloat16 linears of 3 rows or more each way the machine's measurement may set them:
    weights widened to float for FMAs, or bf16 dot products (several chains a row,
    `dpbf16_group`); a build without vdpbf16ps ignores it."""
    before = ops.dpbf16_max_rows
    ops.set_dpbf16_max_rows(request.param)
    yield request.param
    ops.set_dpbf16_max_rows(before)


@pytest.mark.parametrize("rows", [*ROWS, 16, 17, 32, 70])  # AMX: 16-row tiles, 32 per pass
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [70, 96])  # 96: whole AMX tiles of 32 inputs
def test_dense_linear(ops, dpbf16_rows, dtype, rows, has_bias, in_features):
    generator = torch.Generator().manual_seed(4)
    # 100 outputs: a partial last group.
    weight = torch.randn(100, in_features, generator=generator).to(dtype)
    bias = torch.randn(100, generator=generator).to(dtype) if has_bias else None
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = ops.linear(x, ops.pack_dense(weight), bias)
    assert got.dtype == dtype and got.shape == (rows, 100)
    # bfloat16: the output's rounding (values up to ~30).
    tolerance = (1e-4, 1e-5) if dtype == torch.float32 else (0.15, 0.01)
    torch.testing.assert_close(got.float(), expected, atol=tolerance[0], rtol=tolerance[1])


@pytest.mark.parametrize("rows", [5, 20])  # int8 from 16 rows: bf16 dot products or AMX
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_a_large_linear_shares_its_outputs_between_threads(ops, fmt, rows):
    """Weights of several MiB run on several threads, each a share of the output groups:
    the same values as on one thread, bit for bit (3 threads split 125 groups of 16 outputs
    unevenly)."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(2000, 1536, generator=generator)
    packed = (
        quantize_int8(weight).pack()
        if fmt == "int8"
        else ops.pack_dense(weight.to(getattr(torch, fmt)))
    )
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    x = torch.randn(rows, 1536, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.linear(x, packed, None)
        torch.set_num_threads(3)
        assert ops._lib.linear_threads(packed.format, rows, 2000, 1536, 3) == 3
        shared = ops.linear(x, packed, None)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(shared, alone, atol=0, rtol=0)


def _quantized(qtype: QuantType, weight: torch.Tensor) -> QuantizedWeight:
    if qtype is QuantType.INT8:
        return quantize_int8(weight)
    blocks = quantize(weight.numpy(), gguf.GGMLQuantizationType[qtype.name])
    return QuantizedWeight(qtype, blocks, tuple(weight.shape))


def _expected_quantized(ops, quantized: QuantizedWeight, x: torch.Tensor, bias) -> torch.Tensor:
    """Float math on the dequantized weights and, for the integer dot products, the
    activations quantized per block of 32 (what the kernels do to x: to 16 bits where int8
    weights meet them in AMX integer tiles); from the rows where
    the kernels dequantize to bfloat16 (AMX tiles, bf16 dot products), x and the dequantized
    weights rounded to bfloat16."""
    x_used = quantize_activations(x) if quantized.qtype.quantizes_activations else x.float()
    if len(x) <= (ops.split_x_max_rows(quantized.qtype.kernel_format) or 0):
        x_used = quantize_activations(x, SPLIT_X_LEVELS)
    weight_used = quantized.dequantize()
    if len(x) >= (ops.bf16_min_rows(quantized.qtype.kernel_format) or len(x) + 1):
        x_used, weight_used = (t.to(torch.bfloat16).float() for t in (x.float(), weight_used))
    return F.linear(x_used, weight_used, None if bias is None else bias.float())


@pytest.mark.parametrize("rows", [*ROWS, 32, 70])  # AMX: 32 rows per pass
@pytest.mark.parametrize("qtype", list(QuantType))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_multiplies_the_blocks(ops, qtype, dtype, rows):
    """The kernels equal float math on the weights and x as they use them."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 96, generator=generator)
    weight[3] = 0.0  # an all-zero row and block: zero scales
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    x[0, :32] = 0.0
    bias = torch.randn(40, generator=generator).to(dtype)
    quantized = _quantized(qtype, weight)
    expected = _expected_quantized(ops, quantized, x, bias)
    got = ops.linear(x, quantized.pack(), bias)
    assert got.dtype == dtype and got.shape == (rows, 40)
    tolerance = (2e-4, 1e-5) if dtype == torch.float32 else (0.1, 0.01)
    torch.testing.assert_close(got.float(), expected, atol=tolerance[0], rtol=tolerance[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_row_is_the_same_however_many_rows_share_the_call(ops, dtype):
    """A row's products are its own: alone, beside one other row, or among 8. Where int8
    weights meet x split into two bytes (AMX machines), 1-2 rows run in vpdpbusd and 3-16 in
    integer tiles, the same integers and float epilogue: bit for bit. Elsewhere the float
    FMAs (or bf16 dot products) sum in another order at 1-2 rows: equal within rounding."""
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(200, 576, generator=generator)  # 13 groups, the last padded
    bias = torch.randn(200, generator=generator).to(dtype)
    packed = quantize_int8(weight).pack()
    x = torch.randn(8, 576, generator=generator).to(dtype)
    x[1, 32:64] = 0.0  # a block of zeros: a zero scale
    x[0, 5] = 300.0  # a block whose high bytes sum far from zero
    among_8 = ops.linear(x, packed, bias)
    is_split = (ops.split_x_max_rows(packed.format) or 0) >= 8
    for rows in (1, 2):
        got = ops.linear(x[:rows], packed, bias)
        if is_split:
            torch.testing.assert_close(got, among_8[:rows], atol=0, rtol=0)
        else:
            torch.testing.assert_close(got.float(), among_8[:rows].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_1, QuantType.INT8])
def test_quantized_linear_of_many_rows_crosses_chunks_of_groups(ops, qtype):
    """A prompt's rows against weights of several L2 chunks (AMX dequantizes one chunk of
    groups at a time, and every pass of rows crosses it, each pass's products stored during
    the next pass's tiles): the same float math."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(600, 1536, generator=generator)  # 38 groups, 5 per chunk in AMX
    x = torch.randn(70, 1536, generator=generator)
    quantized = _quantized(qtype, weight)
    expected = _expected_quantized(ops, quantized, x, None)
    got = ops.linear(x, quantized.pack(), None)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


def test_linear_silu_mul_refuses_weights_it_cannot_take(ops):
    """Weights `fuses_silu_mul` declines (float32, on every CPU) raise ValueError naming them
    instead of being read as if in AMX's layout."""
    weight = ops.pack_dense(torch.randn(64, 64))
    x = torch.randn(40, 64)
    assert not ops.fuses_silu_mul(weight, 40, torch.float32)
    with pytest.raises(ValueError, match=r"does not take weights of format 0 \[64, 64\] at 40"):
        ops.linear_silu_mul(x, weight)


def test_bf16_linear_of_many_rows_crosses_chunks_of_groups(ops, dpbf16_rows):
    """bfloat16 weights of several L2 chunks (AMX: 21 groups a chunk of 1,536 inputs) against
    rows of three passes, with a bias: every output stored once, the float math."""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(1000, 1536, generator=generator).bfloat16()
    bias = torch.randn(1000, generator=generator).bfloat16()
    x = torch.randn(70, 1536, generator=generator).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float())
    got = ops.linear(x, ops.pack_dense(weight), bias)
    torch.testing.assert_close(got.float(), expected, atol=0.5, rtol=0.01)


# AMX tiles: bf16 from 3 rows, dequantized INT8 from 17 and GGUF from 32 (one pass up to 32)
@pytest.mark.parametrize("rows", [5, 32, 70])
@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_linear_and_silu_fuse_where_amx_tiles_take_the_weights(
    ops, dtype, weights, num_threads, rows
):
    """Where the weights run in AMX tiles, silu(gate) * up comes from one pass over [gate; up]
    (gate group g beside up group g + width / 16, 3 threads sharing 50 gate groups): what
    `linear` then `silu_mul` give, bit for bit (the one-call decode step runs those).
    Elsewhere, and for bfloat16 weights with float32 x, the model runs them."""
    generator = torch.Generator().manual_seed(12)
    width = 800
    weight = torch.randn(2 * width, 1536, generator=generator)
    packed = (
        ops.pack_dense(weight.bfloat16())
        if weights == "bfloat16"
        else _quantized(QuantType[weights.upper()], weight).pack()
    )
    x = torch.randn(rows, 1536, generator=generator).to(dtype)
    min_rows = 3 if weights == "bfloat16" else ops.bf16_min_rows(packed.format)
    is_fused = (
        bool(ops._lib.linear_has_amx())
        and rows >= min_rows
        and (weights != "bfloat16" or dtype == torch.bfloat16)
    )
    assert ops.fuses_silu_mul(packed, rows, dtype) == is_fused
    if not is_fused:
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = ops.linear_silu_mul(x, packed)
        expected = ops.silu_mul(ops.linear(x, packed, None))
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == dtype and got.shape == (rows, width)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_a_linear_called_from_several_threads_at_once_gives_each_its_result(ops):
    """The team's workers serve one call at a time: a call made while another thread's team
    runs computes on its caller alone, with the same values, bit for bit."""
    generator = torch.Generator().manual_seed(7)
    packed = ops.pack_dense(torch.randn(2000, 1536, generator=generator))
    inputs = [torch.randn(20, 1536, generator=generator) for _ in range(4)]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [ops.linear(x, packed, None) for x in inputs]
        torch.set_num_threads(3)
        with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
            results = list(
                pool.map(lambda x: [ops.linear(x, packed, None) for _ in range(20)], inputs)
            )
    finally:
        torch.set_num_threads(previous)
    for got, want in zip(results, expected, strict=True):
        for one in got:
            torch.testing.assert_close(one, want, atol=0, rtol=0)


def test_a_forked_child_starts_its_own_team_workers(ops):
    """The team's workers outlive a call; a child forked after a team ran has none of them
    (fork copies only the calling thread) and starts its own instead of waiting on them."""
    values = torch.arange(4096, dtype=torch.float32) / 64
    expected = float(values.sum())
    assert ops.stream_sum(values, 2) == pytest.approx(expected, rel=1e-6)  # workers started
    pid = os.fork()
    if pid == 0:
        is_right = ops.stream_sum(values, 2) == pytest.approx(expected, rel=1e-6)
        os._exit(0 if is_right else 1)
    deadline = time.monotonic() + 60
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's team never finished")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(waited[1]) == 0


@pytest.mark.parametrize("num_threads", [1, 3])
def test_stream_sum(ops, num_threads):
    values = torch.arange(4096, dtype=torch.float32) / 64
    assert ops.stream_sum(values, num_threads) == pytest.approx(float(values.sum()), rel=1e-6)
    with pytest.raises(ValueError, match="64k elements"):
        ops.stream_sum(values[:100])


def test_named_variant_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr("pdserve.model.kernels.cpu_ops.can_run", lambda variant: False)
    load_cpu_ops.cache_clear()
    try:
        with pytest.raises(ValueError, match="cannot run the avx2 kernels"):
            load_cpu_ops("avx2")
        with pytest.raises(ValueError, match="unknown CPU kernel variant 'sse9'"):
            load_cpu_ops("sse9")
    finally:
        load_cpu_ops.cache_clear()


def test_environment_picks_the_variant(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "portable")
    load_cpu_ops.cache_clear()
    try:
        ops = load_cpu_ops()
        assert ops is None or ops.isa == "portable"
    finally:
        load_cpu_ops.cache_clear()


def test_default_variant_is_the_best_the_cpu_runs(monkeypatch):
    monkeypatch.delenv("PDSERVE_CPU_ISA", raising=False)
    best = next(v for v in VARIANTS if can_run(v))
    ops = load_cpu_ops()
    assert ops is None or ops.isa == best.name


def test_quantized_weight_reads_gguf_blocks_like_gguf():
    from gguf.quants import dequantize

    weight = torch.randn(20, 64, generator=torch.Generator().manual_seed(6))
    for qtype in (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1):
        ggml_type = gguf.GGMLQuantizationType[qtype.name]
        blocks = quantize(weight.numpy(), ggml_type)
        ours = QuantizedWeight(qtype, blocks, (20, 64)).dequantize()
        np.testing.assert_array_equal(ours.numpy(), dequantize(blocks, ggml_type))


def test_the_ctypes_structs_match_the_c_ones(ops, monkeypatch):
    """Every variant's library reports its structs' sizes and the mirrors have them; a mirror
    that lost a field is refused at load."""
    cpu_ops.check_struct_sizes(ops._lib)

    class Shorter(ctypes.Structure):
        _fields_ = cpu_ops._PackedLinear._fields_[:-1]

    monkeypatch.setattr(cpu_ops, "_STRUCTS", (Shorter, *cpu_ops._STRUCTS[1:]))
    with pytest.raises(RuntimeError, match="Shorter is 32 bytes, the C struct 40"):
        CpuOps(ops._lib, ops.isa)


def test_onednn_rows_pad_at_most_an_eighth_and_fit_the_primitive_cache():
    sizes = {onednn_rows(rows) for rows in range(33, 2049)}
    assert len(sizes) * 4 <= ONEDNN_CACHE_CAPACITY  # a decoder layer's 4 weight shapes
    for rows in range(1, 5000):
        padded = onednn_rows(rows)
        assert rows <= padded and (padded - rows) * 8 <= max(rows, 256)


def test_bfloat16_linear_computes_the_padding_rows_an_activation_has_room_for():
    """An activation from `empty_rows` lets oneDNN run a bucketed row count; whatever the
    padding holds (NaN here) stays out of the real rows."""
    generator = torch.Generator().manual_seed(11)
    layer = Linear(576, 960, False, torch.bfloat16, torch.device("cpu"))
    layer.load(torch.randn(960, 576, generator=generator))
    layer.pack()
    assert layer.onednn_weight is not None, "no oneDNN in this torch"
    x = empty_rows(100, 576, torch.bfloat16)
    x.copy_(torch.randn(100, 576, generator=generator))
    padded = x.as_strided((onednn_rows(100), 576), (576, 1))
    padded[100:] = float("nan")
    with torch.inference_mode():
        got, alone = layer(x), layer(x.clone())  # the clone has no room: 100 rows
    assert got.shape == (100, 960) and not got.isnan().any()
    torch.testing.assert_close(got.float(), alone.float(), atol=2e-2, rtol=1e-2)
    assert empty_rows(100, 576, torch.float32).untyped_storage().nbytes() == 100 * 576 * 4


@pytest.mark.parametrize("num_threads", [1, 2])
def test_bfloat16_linear_past_the_kernels_rows_takes_the_path_measured_faster(
    ops, monkeypatch, num_threads
):
    """Past `kernel_max_rows`, bfloat16 weights kept in both layouts run where this machine
    measured them faster (`bf16_linear_choice`, per threads and rows): the startup measure
    times every bucket of rows up to the step budget, and the layer then takes the faster."""
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    layer = Linear(64, 96, False, torch.bfloat16, torch.device("cpu"), ops)
    layer.load(weight)
    layer.pack()
    if layer.kernel_max_rows is None:  # the kernels take every row count: nothing to choose
        assert layer.onednn_weight is None
        return
    rows = layer.kernel_max_rows + 1
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        measure_linear_choices([layer], max_num_new=2 * rows, budget_s=30.0)
        choice = bf16_linear_choice(ops)
        cases = [bf16_linear_case(96, 64, n) for n in (rows, 2 * rows)]
        assert all(json.dumps(case) in choice.timings for case in cases)
        kernel_s, onednn_s = choice.timing(cases[0])
        calls = []
        linear = ops.linear
        monkeypatch.setattr(ops, "linear", lambda *a: calls.append(a) or linear(*a))
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        with torch.inference_mode():
            got = layer(x)
    finally:
        torch.set_num_threads(previous)
    assert bool(calls) == (kernel_s < onednn_s)
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_row_in_its_slot(ops, dtype, kv_dtype):
    """K and V as the model has them (slices of the qkv product: rows 960 values apart) go to
    their slots, scattered and out of order, rounded once to the cache's dtype: what
    index_copy_ writes. Views whose rows are not contiguous are declined, nothing written."""
    generator = torch.Generator().manual_seed(14)
    num_tokens, num_kv_heads, head_dim = 37, 3, 64  # 37 rows: not a whole block
    qkv = torch.randn(num_tokens, 960, generator=generator).to(dtype)
    k = qkv[:, 576:768].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 768:].view(num_tokens, num_kv_heads, head_dim)
    kv_layer = torch.zeros(2, 10, 16, num_kv_heads, head_dim, dtype=kv_dtype)
    slot_mapping = torch.randperm(160, generator=generator)[:num_tokens]
    expected = kv_layer.clone()
    slots = expected.view(2, -1, num_kv_heads, head_dim)
    slots[0].index_copy_(0, slot_mapping, k.to(kv_dtype))
    slots[1].index_copy_(0, slot_mapping, v.to(kv_dtype))
    assert ops.write_kv(k, v, kv_layer, slot_mapping)
    torch.testing.assert_close(kv_layer, expected, atol=0, rtol=0)
    untouched = torch.zeros_like(kv_layer)
    transposed = k.transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous
    assert not ops.write_kv(transposed, transposed, untouched, slot_mapping)
    assert not untouched.any()
