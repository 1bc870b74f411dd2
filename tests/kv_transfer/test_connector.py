"""The connector between two real core `Scheduler`s: the prefill side leases a finished
prompt's blocks, the decode side fetches them and decodes on; failures recompute; nothing
leaks. The model is replaced by a deterministic KV writer (this tests the data plane)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.core.request import FinishReason, Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.scheduler import Scheduler
from pdserve.kv_transfer import KVLeaseError, KVTransferConfig
from pdserve.kv_transfer.connector import KVConnector
from tests.kv_transfer.helpers import bits, tiny_layout

LAYOUT = tiny_layout()
NUM_BLOCKS = 32
FIRST_TOKEN = 555
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and a partial one


class Worker:
    def __init__(self, transport: str, role: str) -> None:
        config = KVTransferConfig(transport=transport, kv_role=role)
        self.connector = KVConnector(config, LAYOUT, NUM_BLOCKS)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_model_len=8192),
            CacheConfig(LAYOUT.block_size, NUM_BLOCKS),
            self.connector,
        )
        self.kv_cache = self.connector.transport.kv_cache
        self.num_computed_per_step: list[int] = []

    def step(self) -> list[Request]:
        """One engine step: apply transfers, schedule, 'compute' KV, sample."""
        self.scheduler.update_kv_transfers()
        output = self.scheduler.schedule()
        for scheduled in output.scheduled:
            _write_kv(self.kv_cache, scheduled.request, scheduled.num_new_tokens)
        self.num_computed_per_step.append(output.num_batched_tokens)
        sampled = {
            s.request.request_id: FIRST_TOKEN + s.request.num_output_tokens
            for s in output.scheduled
            if s.is_sampling
        }
        return self.scheduler.update_from_output(output, sampled)

    def run_until(self, done, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "worker made no progress"
            self.step()

    def close(self) -> None:
        self.connector.close()


def _kv_value(token_id: int, position: int) -> torch.Tensor:
    pattern = torch.arange(LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.head_dim)
    return (
        pattern.view(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        + 1000.0 * token_id
        + position
    )


def _write_kv(kv_cache: torch.Tensor, request: Request, num_new: int) -> None:
    tokens = request.all_token_ids
    for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
        block = request.block_table[position // LAYOUT.block_size]
        kv_cache[:, :, block, position % LAYOUT.block_size] = _kv_value(tokens[position], position)


def _prompt_kv(worker: Worker, request: Request, num_tokens: int) -> torch.Tensor:
    slots = [
        (request.block_table[p // LAYOUT.block_size], p % LAYOUT.block_size)
        for p in range(num_tokens)
    ]
    return torch.stack([worker.kv_cache[:, :, b, o] for b, o in slots])


def _request(request_id: str, max_tokens: int, **kwargs) -> Request:
    return Request(
        request_id, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kwargs
    )


def _prefill_leg(prefill: Worker, request_id: str = "p") -> Request:
    request = _request(request_id, 1, kv_transfer_params={"do_remote_decode": True})
    prefill.scheduler.add_request(request)
    prefill.run_until(lambda: request.is_finished)
    assert request.finish_reason is FinishReason.LENGTH
    assert request.kv_transfer_params["do_remote_prefill"] is True
    assert request.kv_transfer_params["first_token_id"] == FIRST_TOKEN
    return request


def _decode_leg(decode: Worker, sent: Request, request_id: str = "d") -> Request:
    request = _request(request_id, 3, kv_transfer_params=sent.kv_transfer_params)
    request.output_token_ids = [FIRST_TOKEN]
    decode.scheduler.add_request(request)
    return request


@pytest.fixture(params=["shm", "tcp"])
def workers(request):
    prefill = Worker(request.param, "kv_producer")
    decode = Worker(request.param, "kv_consumer")
    yield prefill, decode
    decode.close()
    prefill.close()


def test_decode_continues_from_remote_kv_and_nothing_leaks(workers):
    prefill, decode = workers
    sent = _prefill_leg(prefill)
    assert prefill.scheduler.block_manager.num_free_blocks < NUM_BLOCKS  # held under lease

    received = _decode_leg(decode, sent)
    decode.step()
    assert received.status is RequestStatus.WAITING_FOR_REMOTE_KV
    decode.run_until(lambda: received.num_computed_tokens >= len(PROMPT))
    assert torch.equal(
        bits(_prompt_kv(decode, received, len(PROMPT))),
        bits(_prompt_kv(prefill, sent, len(PROMPT))),
    )
    decode.run_until(lambda: received.is_finished)
    assert received.output_token_ids == [FIRST_TOKEN, FIRST_TOKEN + 1, FIRST_TOKEN + 2]
    # The decode worker never ran the prompt: one token per step.
    assert max(decode.num_computed_per_step) == 1
    result = decode.connector.pop_transfer_result("d")
    assert result.is_ok and result.stats.num_bytes == LAYOUT.nbytes(3)

    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert decode.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_failed_transfer_recomputes_locally(workers):
    prefill, decode = workers
    sent = _prefill_leg(prefill)
    prefill.connector.transport.leases.revoke("p")
    received = _decode_leg(decode, sent)
    decode.run_until(lambda: received.is_finished)
    assert max(decode.num_computed_per_step) == len(PROMPT) + 1  # prompt recomputed here
    assert isinstance(decode.connector.pop_transfer_result("d").error, KVLeaseError)
    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert decode.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_local_prefix_hit_fetches_only_the_rest(workers):
    prefill, decode = workers
    local = _request("local", 1)
    decode.scheduler.add_request(local)
    decode.run_until(lambda: local.is_finished)  # caches blocks 0 and 1 of the prompt

    sent = _prefill_leg(prefill)
    received = _decode_leg(decode, sent)
    decode.run_until(lambda: received.num_computed_tokens >= len(PROMPT))
    assert decode.connector.pop_transfer_result("d").stats.num_bytes == LAYOUT.nbytes(1)
    assert torch.equal(
        bits(_prompt_kv(decode, received, len(PROMPT))),
        bits(_prompt_kv(prefill, sent, len(PROMPT))),
    )
    decode.run_until(lambda: received.is_finished)
    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_aborted_prefill_leg_is_not_leased(workers):
    prefill, _ = workers
    request = _request("gone", 1, kv_transfer_params={"do_remote_decode": True})
    prefill.scheduler.add_request(request)
    prefill.scheduler.schedule()  # admitted, blocks allocated
    prefill.scheduler.abort_request("gone")
    assert request.kv_transfer_params == {"do_remote_decode": True}
    assert prefill.connector.transport.leases.num_leases == 0
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_abort_while_receiving_holds_blocks_until_the_fetch_ends(workers):
    prefill, decode = workers
    sent = _prefill_leg(prefill)
    received = _decode_leg(decode, sent)
    decode.step()
    assert received.status is RequestStatus.WAITING_FOR_REMOTE_KV
    decode.scheduler.abort_request("d")
    decode.run_until(lambda: not decode.scheduler.held)
    assert decode.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert decode.connector.pop_transfer_result("d") is None
    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
