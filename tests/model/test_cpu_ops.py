"""The fused CPU kernels equal the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.model.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no AVX-512 CPU or no C compiler")
HEADS = [(9, 3, 64), (4, 4, 128), (8, 1, 32)]  # (query heads, KV heads, head_dim)
DTYPES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]


def _tables(lengths, block_size, num_blocks, generator):
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(physical[:blocks])
        physical = physical[blocks:]
    return tables


@pytest.mark.parametrize(("dtype", "atol"), DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_paged_decode_matches_torch_path(
    dtype, atol, num_heads, num_kv_heads, head_dim, block_size
):
    generator = torch.Generator().manual_seed(0)
    num_blocks = 1280 // block_size
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
        dtype
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
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])  # 40: a partial last vector
def test_add_rms_norm(dtype, atol, hidden):
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
def test_rotary_in_place(dtype, atol, head_dim):
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


@pytest.mark.parametrize(("dtype", "atol"), DTYPES)
def test_silu_mul(dtype, atol):
    gate_up = (torch.randn(3, 2 * 200, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(
        ops.silu_mul(gate_up).float(), F.silu(gate) * up, atol=atol, rtol=atol
    )


@pytest.mark.skipif(ops is None or ops._linear is None, reason="no AVX-512 BF16 dot products")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("has_bias", [False, True])
def test_streaming_linear(rows, has_bias):
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 70, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if has_bias else None
    x = torch.randn(rows, 70, generator=generator).bfloat16()
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = ops.linear(x, ops.pack_linear(weight), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.01)
