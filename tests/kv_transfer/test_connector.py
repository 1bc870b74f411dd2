"""The connector between two real core `Scheduler`s: the prefill side leases a finished
prompt's blocks, the decode side fetches them and decodes on; failures recompute; nothing
leaks; the scheduler's queries change nothing. The model is replaced by a deterministic KV
writer (this tests the data plane)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.core.kv_connector import KVAdmission, MultiConnector
from pdserve.core.request import FinishReason, Request, RequestStatus
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.core.scheduler import Scheduler
from pdserve.kv_transfer import KVTransferConfig, KVTransferParams
from pdserve.kv_transfer.connector import KVConnector
from tests.kv_transfer.helpers import bits, count_parses, engine_cache, tiny_layout

LAYOUT = tiny_layout()
NUM_BLOCKS = 32
FIRST_TOKEN = 555
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and a partial one


class Worker:
    def __init__(self, transport: str, role: str, num_blocks: int = NUM_BLOCKS) -> None:
        config = KVTransferConfig(transport=transport, kv_role=role)
        self.connector = KVConnector(config, LAYOUT)
        self.connector.register_kv_caches(engine_cache(config, LAYOUT, num_blocks))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_model_len=8192),
            CacheConfig(LAYOUT.block_size, num_blocks),
            self.connector,
        )
        self.kv_cache = self.connector.transport.kv_cache
        self.num_computed_per_step: list[int] = []

    def add(self, request: Request, kv_transfer_params: dict | None = None) -> None:
        """What the engine does: the connector parses the params, then the request queues."""
        if kv_transfer_params:
            admission = self.connector.add_request(
                request.request_id, kv_transfer_params, request.num_prompt_tokens
            )
            request.output_token_ids = list(admission.output_token_ids)
        self.scheduler.add_request(request)

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


def _request(request_id: str, max_tokens: int, prompt: list[int] = PROMPT) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _prefill_leg(prefill: Worker, request_id: str = "p") -> Request:
    request = _request(request_id, 1)
    prefill.add(request, {"do_remote_decode": True})
    prefill.run_until(lambda: request.is_finished)
    assert request.finish_reason is FinishReason.LENGTH
    assert request.kv_hand_off["do_remote_prefill"] is True
    assert request.kv_hand_off["first_token_id"] == FIRST_TOKEN
    return request


def _decode_leg(decode: Worker, sent: Request, request_id: str = "d") -> Request:
    request = _request(request_id, 3)
    decode.add(request, sent.kv_hand_off)
    assert request.output_token_ids == [FIRST_TOKEN]
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
    result = decode.connector.take_result("d").transfer
    assert result.error is None and result.num_bytes == LAYOUT.nbytes(3)

    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert decode.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_failed_transfer_recomputes_locally(workers):
    prefill, decode = workers
    sent = _prefill_leg(prefill)
    prefill.connector.transport.leases.release("p")  # the fetch will be refused
    received = _decode_leg(decode, sent)
    decode.run_until(lambda: received.is_finished)
    assert max(decode.num_computed_per_step) == len(PROMPT) + 1  # prompt recomputed here
    assert "lease" in decode.connector.take_result("d").transfer.error
    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert decode.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_local_prefix_hit_fetches_only_the_rest(workers):
    prefill, decode = workers
    local = _request("local", 1)
    decode.add(local)
    decode.run_until(lambda: local.is_finished)  # caches blocks 0 and 1 of the prompt

    sent = _prefill_leg(prefill)
    received = _decode_leg(decode, sent)
    decode.run_until(lambda: received.num_computed_tokens >= len(PROMPT))
    assert decode.connector.take_result("d").transfer.num_bytes == LAYOUT.nbytes(1)
    assert torch.equal(
        bits(_prompt_kv(decode, received, len(PROMPT))),
        bits(_prompt_kv(prefill, sent, len(PROMPT))),
    )
    decode.run_until(lambda: received.is_finished)
    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def test_aborted_prefill_leg_is_not_leased(workers):
    prefill, _ = workers
    request = _request("gone", 1)
    prefill.add(request, {"do_remote_decode": True})
    prefill.scheduler.schedule()  # admitted, blocks allocated
    prefill.scheduler.abort_request("gone")
    assert request.kv_hand_off is None
    assert prefill.connector.transport.leases.num_held_blocks == 0
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
    assert decode.connector.take_result("d").transfer is None
    prefill.run_until(lambda: not prefill.scheduler.held)
    assert prefill.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


def _spy(monkeypatch, obj, name: str) -> list:
    """Record each call of `obj.name` as (args, result); the real method still runs."""
    calls = []
    real = getattr(obj, name)

    def spy(*args):
        result = real(*args)
        calls.append((args, result))
        return result

    monkeypatch.setattr(obj, name, spy)
    return calls


def test_the_query_is_pure(workers):
    """Asking how many tokens arrive, however often and with whatever local hit, neither
    releases the sender's lease nor uses up the request's remote KV."""
    prefill, decode = workers
    sent = _prefill_leg(prefill)
    received = _request("d", 3)
    admission = decode.connector.add_request("d", sent.kv_hand_off, len(PROMPT))
    received.output_token_ids = list(admission.output_token_ids)
    answers = [decode.connector.get_num_new_matched_tokens(received, n) for n in (0, 0, 8, 12, 0)]
    assert answers == [10, 10, 2, 0, 10]
    decode.scheduler.add_request(received)
    decode.run_until(lambda: received.is_finished)
    # A release queued by a query would have run before this fetch and made it fail.
    assert decode.connector.take_result("d").transfer.num_bytes == LAYOUT.nbytes(3)
    assert max(decode.num_computed_per_step) == 1


def test_a_remote_request_blocked_on_blocks_is_asked_again_and_nothing_happens(monkeypatch):
    prefill = Worker("tcp", "kv_producer")
    decode = Worker("tcp", "kv_consumer", num_blocks=4)
    try:
        local = _request("local", 4, prompt=list(range(200, 208)))  # holds 2-3 of 4 blocks
        decode.add(local)
        decode.step()
        queries = _spy(monkeypatch, decode.connector, "get_num_new_matched_tokens")
        received = _decode_leg(decode, _prefill_leg(prefill))  # needs 3 blocks
        while not local.is_finished:
            decode.step()
            assert received.status is RequestStatus.WAITING
        assert len(queries) >= 2 and {answer for _, answer in queries} == {10}
        assert prefill.connector.transport.leases.num_held_blocks == 3
        decode.run_until(lambda: received.is_finished)
        assert decode.connector.take_result("d").transfer.num_bytes == LAYOUT.nbytes(3)
        prefill.run_until(lambda: not prefill.scheduler.held)
    finally:
        decode.close()
        prefill.close()


def test_request_finished_returns_the_hand_off_and_leaves_the_request_alone(workers, monkeypatch):
    prefill, _ = workers
    seen = []
    real = prefill.connector.request_finished

    def spy(request):
        before = copy.deepcopy(vars(request))
        result = real(request)
        seen.append((before, copy.deepcopy(vars(request)), result))
        return result

    monkeypatch.setattr(prefill.connector, "request_finished", spy)
    sent = _prefill_leg(prefill)
    [(before, after, (is_held, hand_off))] = seen
    assert before == after and before["kv_hand_off"] is None
    assert is_held and hand_off == sent.kv_hand_off  # the scheduler put it on the output
    params = KVTransferParams.from_dict(hand_off)
    assert params.remote_block_ids == tuple(sent.block_table[:3])
    assert params.remote_num_tokens == len(PROMPT)


def test_a_decode_leg_is_parsed_once(workers, monkeypatch):
    prefill, decode = workers
    sent = _prefill_leg(prefill)
    parsed = count_parses(monkeypatch)
    received = _decode_leg(decode, sent)
    decode.run_until(lambda: received.is_finished)
    assert parsed == [sent.kv_hand_off]
    assert decode.connector.take_result("d").transfer.error is None


def test_bad_params_are_refused_naming_the_field(workers):
    prefill, decode = workers
    hand_off = _prefill_leg(prefill).kv_hand_off
    cases = {
        "unknown field": {"forged": True},
        "layout_hash differs": {**hand_off, "layout_hash": "0" * 16},
        "remote_num_tokens must equal": {**hand_off, "remote_num_tokens": 3},
    }
    for message, params in cases.items():
        with pytest.raises(InvalidParameterError, match=message) as info:
            decode.connector.add_request("bad", params, len(PROMPT))
        assert info.value.param == "kv_transfer_params"
    with pytest.raises(InvalidParameterError, match="takes no part in KV transfer"):
        MultiConnector().add_request("x", {"do_remote_decode": True}, len(PROMPT))
    assert MultiConnector().add_request("x", None, len(PROMPT)) == KVAdmission()
