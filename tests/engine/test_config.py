"""The engine's one config tree: built from flat keyword arguments, defaults of its fields."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.config import (
    DEFAULT_CHUNKED_BUDGET,
    CacheConfig,
    SchedulerConfig,
    SchedulingPolicy,
)
from pdserve.engine.config import EngineConfig


def test_flat_kwargs_land_on_their_branch_of_the_tree():
    config = EngineConfig.from_kwargs(
        mode="colocated",
        max_num_seqs=8,
        max_model_len=1000,
        block_size=32,
        num_kv_blocks=10,
        enable_prefix_caching=False,
        dtype="float32",
        seed=3,
    )
    assert config.scheduler == SchedulerConfig(
        SchedulingPolicy.COLOCATED, max_num_seqs=8, max_model_len=1000
    )
    assert config.cache == CacheConfig(block_size=32, num_blocks=10, enable_prefix_caching=False)
    assert (config.dtype, config.seed, config.kv_transfer) == ("float32", 3, None)


def test_no_kwargs_is_every_field_default():
    assert EngineConfig.from_kwargs() == EngineConfig()


def test_an_unknown_name_is_refused():
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_kwargs(max_num_seq=8)


def test_leaf_names_are_unique_across_the_tree():
    names = [
        f.name
        for config in (EngineConfig, SchedulerConfig, CacheConfig)
        for f in dataclasses.fields(config)
    ]
    assert len(names) == len(set(names))


def test_the_budget_follows_the_policy():
    assert SchedulerConfig().max_num_batched_tokens == DEFAULT_CHUNKED_BUDGET
    assert SchedulerConfig(max_num_batched_tokens=64).max_num_batched_tokens == 64
    colocated = SchedulerConfig("colocated", max_model_len=300)
    assert colocated.max_num_batched_tokens == 300
    # Without a context length yet, the colocated budget follows it once the engine sets it.
    unresolved = SchedulerConfig("colocated")
    assert unresolved.max_num_batched_tokens is None
    assert dataclasses.replace(unresolved, max_model_len=200).max_num_batched_tokens == 200


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_model_len": -1}, "max_model_len must be a positive integer"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"num_kv_blocks": 0}, "num_blocks must be a positive integer"),
        ({"kv_cache_memory_gb": 0.0}, "kv_cache_memory_gb must be positive"),
        ({"num_threads": 0}, "num_threads must be a positive integer"),
        ({"dtype": "int8"}, "dtype must be one of"),
    ],
)
def test_bad_values_name_their_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)
