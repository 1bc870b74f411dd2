"""`KVStoreConnector` under the real `core.Scheduler`: a prompt prefix computed on one worker
is read by another, which computes only the rest; a damaged or vanished store value costs
only recomputation; no path leaks a KV block."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import Scheduler
from pdserve.kv_store import ErrorKind
from pdserve.kv_store.connector import KVStoreConnector
from pdserve.kv_store.store import cache_bytes
from tests.kv_store.conftest import NUM_CACHE_BLOCKS, TINY, empty_cache

BLOCK = TINY.block_size
PREFIX = list(range(1000, 1000 + 10 * BLOCK))  # ten full blocks shared by every prompt


def _kv_of(block_hash: int) -> np.ndarray:
    """The 'model': a block's KV is a function of its chained hash (of the whole prefix)."""
    rng = np.random.default_rng(block_hash % 2**32)
    return rng.integers(0, 256, (2 * TINY.num_layers, TINY.payload_nbytes // 4), np.uint8)


class Worker:
    """A scheduler, its store connector and a KV cache; `step()` plays the model."""

    def __init__(self, make_store, url: str, **store_config) -> None:
        self.cache = cache_bytes(empty_cache())
        self.connector = KVStoreConnector(make_store(url, **store_config), self.cache)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=1024, max_model_len=NUM_CACHE_BLOCKS * BLOCK),
            CacheConfig(BLOCK, NUM_CACHE_BLOCKS),
            self.connector,
        )
        self.num_computed_tokens = 0  # tokens this worker's "model" computed

    def add(self, request_id: str, suffix: list[int]) -> Request:
        request = Request(
            request_id, PREFIX + suffix, SamplingParams(max_tokens=2, ignore_eos=True)
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        self.scheduler.update_kv_transfers()
        output = self.scheduler.schedule()
        if output.is_empty:
            time.sleep(0.001)  # only a read in flight (as the engine waits)
        self.num_computed_tokens += output.num_batched_tokens
        sampled = {s.request.request_id: 7 for s in output.scheduled if s.is_sampling}
        for s in output.scheduled:  # the forward pass writes the KV of the new tokens
            request = s.request
            end = (request.num_computed_tokens + s.num_new_tokens) // BLOCK
            for i in range(request.num_computed_tokens // BLOCK, end):
                hashes = self.connector._hashes(request)
                self.cache[:, request.block_table[i]] = _kv_of(hashes[i])
        self.scheduler.update_from_output(output, sampled)
        for s in output.scheduled:
            if not s.request.is_finished:
                self.connector.save_computed_blocks(s.request)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if (
                not self.scheduler.has_unfinished_requests()
                and not self.scheduler.has_pending_transfers()
            ):
                return
            self.step()
        raise AssertionError("requests did not finish")

    def assert_no_leaks(self) -> None:
        manager = self.scheduler.block_manager
        assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture
def url(tmp_path) -> str:
    return f"local:{tmp_path}"


def _seed_store(make_store, url: str) -> Worker:
    first = Worker(make_store, url)
    first.add("first", [1, 2, 3])
    first.run()
    assert first.connector.store.flush()
    first.assert_no_leaks()
    assert first.connector.store.metrics.value("pdserve:kv_store_written_bytes_total") > 0
    return first


def test_second_worker_computes_only_the_suffix(make_store, url):
    _seed_store(make_store, url)
    second = Worker(make_store, url)
    request = second.add("second", [9, 8, 7, 6, 5])
    second.step()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV  # reading, not computing
    second.run()
    # The prefix's ten blocks came from the store: only the suffix (and the decode) computed.
    assert second.num_computed_tokens == 5 + 1
    for i in range(10):
        block_id = second.scheduler.block_manager._cached[request.block_hashes[i]]
        assert np.array_equal(second.cache[:, block_id], _kv_of(request.block_hashes[i]))
    metrics = second.connector.store.metrics
    assert metrics.value("pdserve:kv_store_hit_tokens_total") == 10 * BLOCK
    second.assert_no_leaks()


def test_a_damaged_block_cuts_the_read_and_the_rest_is_computed(make_store, url):
    first = _seed_store(make_store, url)
    request = first.add("probe", [4])  # only to compute its hashes
    store = first.connector.store
    store.backend.put_many([(store.keys.key(first.connector._hashes(request)[6]), b"x" * 1000)])
    second = Worker(make_store, url)
    second.add("second", [9, 8, 7])
    second.run()
    assert second.num_computed_tokens == (10 - 6) * BLOCK + 3 + 1
    assert (
        second.connector.store.metrics.value(
            "pdserve:kv_store_errors_total", kind=ErrorKind.CORRUPT.value
        )
        == 1
    )
    second.assert_no_leaks()


def test_a_read_that_gets_nothing_is_recomputed_whole(make_store, url):
    first = _seed_store(make_store, url)
    store = first.connector.store
    probe = first.add("probe", [4])
    store.backend.put_many([(store.keys.key(first.connector._hashes(probe)[0]), b"x" * 1000)])
    second = Worker(make_store, url)
    request = second.add("second", [9, 8, 7])
    second.run()
    assert second.num_computed_tokens == len(request.prompt_token_ids) + 1
    second.assert_no_leaks()


def test_abort_while_reading_frees_the_blocks_after_the_read(make_store, url):
    _seed_store(make_store, url)
    second = Worker(make_store, url)
    second.add("second", [9, 8, 7])
    second.step()
    assert second.scheduler.abort_request("second") is not None
    second.run()
    second.assert_no_leaks()


def test_hits_below_the_break_even_are_recomputed(make_store, url):
    _seed_store(make_store, url)
    second = Worker(make_store, url)
    policy = second.connector.store.policy
    policy.prefill_tokens_per_s, policy.bandwidth = 1e9, 1e3  # recomputing is far cheaper
    request = second.add("second", [9, 8, 7])
    second.run()
    assert second.num_computed_tokens == len(request.prompt_token_ids) + 1
    assert second.connector.store.metrics.value("pdserve:kv_store_hit_tokens_total") == 0
