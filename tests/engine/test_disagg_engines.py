"""Prefill and decode engines exchanging real KV blocks (shm and tcp) inside one process."""

import time

import pytest

from pdserve.core.request import FinishReason
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.config import KVTransferConfig
from tests.kv_transfer.helpers import count_parses

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(loaded, role=None, transport="tcp", policy="recompute", **kwargs):
    kv = (
        KVTransferConfig(
            transport=transport, kv_role=role, kv_lease_timeout=10.0, kv_transfer_timeout=2.0
        )
        if role
        else None
    )
    config = EngineConfig.from_kwargs(
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        kv_transfer=kv,
        kv_failure_policy=policy,
        **kwargs,
    )
    return LLMEngine(config, loaded=loaded)


def _run(engine, request_id, prompt, params, kv_transfer_params=None, timeout=60.0):
    engine.add_request(request_id, prompt, params, kv_transfer_params)
    outputs = []
    deadline = time.monotonic() + timeout
    while not (outputs and outputs[-1].finished) and time.monotonic() < deadline:
        outputs += [o for o in engine.step() if o.request_id == request_id]
    assert outputs and outputs[-1].finished, "request did not finish"
    return outputs


def _tokens(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def _prefill_leg(prefill, request_id, prompt):
    outputs = _run(
        prefill,
        request_id,
        prompt,
        SamplingParams(max_tokens=1, temperature=0),
        {"do_remote_decode": True},
    )
    params = outputs[-1].kv_transfer_params
    assert params["do_remote_prefill"] and params["first_token_id"] == _tokens(outputs)[0]
    return params


@pytest.fixture(scope="module")
def reference(loaded_fp32, chat_token_ids):
    engine = _engine(loaded_fp32)
    return [_tokens(_run(engine, str(i), p, PARAMS)) for i, p in enumerate(chat_token_ids[:2])]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_decode_from_transferred_kv_matches_local(
    loaded_fp32, chat_token_ids, reference, transport, monkeypatch
):
    prefill = _engine(loaded_fp32, "kv_producer", transport)
    decode = _engine(loaded_fp32, "kv_consumer", transport)
    for i, prompt in enumerate(chat_token_ids[:2]):
        params = _prefill_leg(prefill, f"p{i}", prompt)
        with monkeypatch.context() as patch:
            parsed = count_parses(patch)
            outputs = _run(decode, f"d{i}", prompt, PARAMS, params)
        assert parsed == [params]  # once, at admission
        assert _tokens(outputs) == reference[i]
        assert all(o.kv_transfer_params is None for o in outputs)  # a decode leg hands nothing on
        assert outputs[0].kv_transfer.num_bytes > 0
        # The decode side computed only the first token's KV, never the prompt.
        assert outputs[-1].num_output_tokens == PARAMS.max_tokens
    # Second prompt shares the chat template's system prefix: fewer blocks were fetched.
    while prefill.has_unfinished_requests():  # leases released by the decode side
        prefill.step()
    for engine in (prefill, decode):
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        engine.shutdown()


def test_a_decode_legs_first_token_leaves_as_its_kv_lands(loaded_fp32, chat_token_ids, reference):
    """Not a forward pass later: the step that emits it computes nothing, and the first
    token is on its way while the second computes."""
    prefill = _engine(loaded_fp32, "kv_producer", "tcp")
    decode = _engine(loaded_fp32, "kv_consumer", "tcp")
    prompt = chat_token_ids[0]
    decode.add_request("d", prompt, PARAMS, _prefill_leg(prefill, "p", prompt))
    deadline = time.monotonic() + 60
    outputs = []
    while not outputs:
        assert time.monotonic() < deadline, "the KV never landed"
        num_steps = decode.get_stats().num_steps
        outputs = decode.step()
    assert [t for o in outputs for t in o.new_token_ids] == reference[0][:1]
    assert decode.get_stats().num_steps == num_steps  # no forward pass ran for it
    rest = _run(decode, "e", prompt, PARAMS)  # the engine goes on serving
    assert _tokens(rest) == reference[0]
    for engine in (prefill, decode):
        engine.shutdown()


@pytest.mark.parametrize(
    ("policy", "reason"), [("recompute", FinishReason.LENGTH), ("fail", FinishReason.ERROR)]
)
def test_transfer_that_never_arrives(loaded_fp32, chat_token_ids, reference, policy, reason):
    prefill = _engine(loaded_fp32, "kv_producer", "tcp")
    decode = _engine(loaded_fp32, "kv_consumer", "tcp", policy=policy)
    params = _prefill_leg(prefill, "p", chat_token_ids[0])
    prefill.shutdown()  # the prefill worker is gone: nothing will arrive
    outputs = _run(decode, "d", chat_token_ids[0], PARAMS, params)
    assert outputs[-1].finish_reason is reason
    if reason is FinishReason.LENGTH:
        assert _tokens(outputs) == reference[0]
    stats = decode.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    decode.shutdown()


def test_mismatched_layout_is_refused(loaded_fp32, chat_token_ids):
    prefill = _engine(loaded_fp32, "kv_producer", "tcp")
    decode = _engine(loaded_fp32, "kv_consumer", "tcp", block_size=32)
    params = _prefill_leg(prefill, "p", chat_token_ids[0])
    with pytest.raises(InvalidParameterError, match="block_size 32"):
        decode.add_request("d", chat_token_ids[0], PARAMS, params)
    for engine in (prefill, decode):
        engine.shutdown()


def test_plain_engine_refuses_kv_params(loaded_fp32, chat_token_ids):
    with pytest.raises(InvalidParameterError, match="--role"):
        _engine(loaded_fp32).add_request("x", chat_token_ids[0], PARAMS, {"do_remote_decode": True})
