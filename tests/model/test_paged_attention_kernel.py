"""The native CPU decode kernel equals the torch decode path."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.model.kernels.paged_decode import load_paged_decode_kernel

kernel = load_paged_decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX-512 CPU or no C compiler")


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128),
                                                                     (8, 1, 32)])
def test_kernel_matches_torch_path(dtype, atol, num_heads, num_kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 64
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator
                        ).to(dtype)
    seq_lens = [1, 16, 17, 300, 45]
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    seqs = []
    for n in seq_lens:
        blocks = -(-n // block_size)
        seqs.append((physical[:blocks], n - 1, 1))
        physical = physical[blocks:]
    meta = AttentionMetadata.build(seqs, block_size, "cpu")
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    torch_path = TorchAttentionBackend(scale, use_cpu_kernel=False)._decode(q, cache,
                                                                            meta.decode)
    native = kernel(q, cache, meta.decode.block_tables, meta.decode.seq_lens,
                    meta.decode.max_len, scale)
    torch.testing.assert_close(native.float(), torch_path.float(), atol=atol, rtol=0)
