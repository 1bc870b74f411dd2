"""A real `redis-server` per test on a free loopback port, tiny layouts and their blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from pdserve.core.block_manager import extend_block_hashes
from pdserve.kv_store import (
    BlockRef,
    KVStore,
    KVStoreConfig,
    LayoutFingerprint,
    block_refs,
)
from pdserve.kv_store.redis_server import RedisServer as PlainRedisServer
from pdserve.kv_store.redis_server import find_redis_server
from pdserve.kv_store.store import cache_bytes

REDIS_SERVER = find_redis_server()
TINY = LayoutFingerprint(
    model_id="tiny-test-model",
    dtype="float32",
    kv_dtype="float32",
    quantization=None,
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
NUM_CACHE_BLOCKS = 64
REPO_ROOT = Path(__file__).resolve().parents[2]


class RedisServer(PlainRedisServer):
    """The server, with plain redis-py clients to plant values and read server stats."""

    def __init__(self, work_dir: Path, *extra_args: str) -> None:
        self._clients: list[redis.Redis] = []
        super().__init__(work_dir, *extra_args)

    def client(self, **options) -> redis.Redis:
        client = redis.Redis(port=self.port, **options)
        self._clients.append(client)
        return client

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        super().stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (make install-test installs it)")
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def make_store() -> Iterator:
    """Build `KVStore`s that are closed after the test."""
    stores: list[KVStore] = []

    def make(url: str, fingerprint: LayoutFingerprint = TINY, **config) -> KVStore:
        options = {"reconnect_backoff_s": 0.05, "max_reconnect_backoff_s": 0.2, **config}
        store = KVStore(KVStoreConfig(url, **options), fingerprint)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@dataclass
class Sequence:
    """A token sequence, its full blocks and a cache holding their KV."""

    token_ids: list[int]
    blocks: list[BlockRef]
    cache: np.ndarray  # [num_layers, 2, NUM_CACHE_BLOCKS, block_size, heads, dim]
    block_ids: list[int]

    @property
    def cache_bytes(self) -> np.ndarray:
        return cache_bytes(self.cache)


def make_sequence(
    num_blocks: int, seed: int = 0, fingerprint: LayoutFingerprint = TINY, first_token: int = 0
) -> Sequence:
    """`num_blocks` full blocks of tokens in random cache blocks filled with random KV."""
    rng = np.random.default_rng(seed)
    size = fingerprint.block_size
    token_ids = [first_token, *rng.integers(0, 50_000, num_blocks * size - 1).tolist()]
    hashes = extend_block_hashes([], token_ids, size)
    shape = (fingerprint.num_layers, 2, NUM_CACHE_BLOCKS, size)
    cache = rng.standard_normal((*shape, fingerprint.num_kv_heads, fingerprint.head_dim))
    cache = cache.astype(fingerprint.kv_dtype)
    block_ids = rng.choice(NUM_CACHE_BLOCKS, num_blocks, replace=False).tolist()
    return Sequence(token_ids, block_refs(hashes, token_ids, size, 0, num_blocks), cache, block_ids)


def empty_cache(fingerprint: LayoutFingerprint = TINY) -> np.ndarray:
    shape = (fingerprint.num_layers, 2, NUM_CACHE_BLOCKS, fingerprint.block_size)
    return np.zeros((*shape, fingerprint.num_kv_heads, fingerprint.head_dim), fingerprint.kv_dtype)


def blocks_equal(a: np.ndarray, a_ids: list[int], b: np.ndarray, b_ids: list[int]) -> bool:
    return np.array_equal(a[:, :, a_ids], b[:, :, b_ids])


def sleep_past_backoff(store: KVStore) -> None:
    time.sleep(store.config.max_reconnect_backoff_s + 0.05)
