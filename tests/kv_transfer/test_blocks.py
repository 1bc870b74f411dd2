"""The copy primitives: every path (slice runs, indexed) moves exactly the named blocks."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.kv_transfer import KVProtocolError
from pdserve.kv_transfer.blocks import (
    StagedBlocks,
    block_runs,
    check_cache,
    copy_blocks,
    layout_of,
)
from tests.kv_transfer.helpers import bits, reference_cache, tiny_layout

LAYOUT = tiny_layout("bfloat16")


def test_block_runs_coalesce_only_where_both_sides_are_consecutive():
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [(4, 0, 2), (6, 7, 1), (9, 8, 2)]
    assert block_runs([], []) == []


def _ids(num: int, seed: int, contiguous: bool) -> list[int]:
    if contiguous:
        return list(range(seed, seed + num))
    ids = list(range(64))
    random.Random(seed).shuffle(ids)
    return ids[:num]


@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_and_staged_paths_match_advanced_indexing(contiguous):
    src = reference_cache(LAYOUT, seed=1)
    src_ids, dst_ids = _ids(20, 3, contiguous), _ids(20, 30, contiguous)
    expected = torch.zeros_like(src)
    expected[:, :, dst_ids] = src[:, :, src_ids]

    direct = torch.zeros_like(src)
    copy_blocks(direct, dst_ids, src, src_ids)
    assert torch.equal(bits(direct), bits(expected))

    staged = torch.zeros_like(src)
    layer = torch.empty(1, 2, len(src_ids), *LAYOUT.block_shape, dtype=src.dtype)
    gather, scatter = StagedBlocks(src_ids), StagedBlocks(dst_ids)
    for index in range(LAYOUT.num_layers):
        gather.gather(src[index : index + 1], layer)
        scatter.scatter(staged[index : index + 1], layer)
    assert torch.equal(bits(staged), bits(expected))


def test_cache_checks_name_the_problem():
    cache = torch.zeros(LAYOUT.cache_shape(4), dtype=torch.bfloat16)
    assert layout_of(cache, LAYOUT.model_id) == LAYOUT
    with pytest.raises(KVProtocolError, match="must have shape"):
        layout_of(cache[0], "m")
    with pytest.raises(KVProtocolError, match="not supported"):
        layout_of(cache.to(torch.float64), "m")
    with pytest.raises(KVProtocolError, match="does not match"):
        check_cache(cache.float(), LAYOUT)
    with pytest.raises(KVProtocolError, match="contiguous"):
        check_cache(cache.transpose(0, 1).contiguous().transpose(0, 1), LAYOUT)
