"""The native CPU decode kernel equals the torch decode path."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.model.kernels.paged_attention import load_paged_attention_kernel

kernel = load_paged_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX-512 CPU or no C compiler")
HEADS = [(9, 3, 64), (4, 4, 128), (8, 1, 32)]  # (query heads, KV heads, head_dim)
DTYPES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]


def _random_cache(num_kv_heads, head_dim, dtype, block_size, num_blocks):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                       generator=generator).to(dtype), generator


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
def test_decode_matches_torch_path(dtype, atol, num_heads, num_kv_heads, head_dim, block_size):
    num_blocks = 1280 // block_size
    cache, generator = _random_cache(num_kv_heads, head_dim, dtype, block_size, num_blocks)
    lengths = [1, 16, 17, 300, 45, 33]
    tables = _tables(lengths, block_size, num_blocks, generator)
    seqs = [(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    meta = AttentionMetadata.build(seqs, block_size, "cpu")
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    expected = TorchAttentionBackend(scale, use_cpu_kernel=False)._decode(
        q, cache, meta.decode, None)
    got = kernel.decode(q, cache, meta.decode.block_tables, meta.decode.seq_lens, scale)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)
