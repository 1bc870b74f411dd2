"""The paged KV cache: one tensor for all layers.

Shape [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. A token at
position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size`; a block is contiguous per layer and per K/V, which is what KV transfer moves.
"""

from __future__ import annotations

import torch

from pdserve.model.config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zero-filled cache (zeros so that no read ever meets uninitialised NaNs)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}"
        )
    return torch.zeros(
        config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return (
        config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element_size
    )
