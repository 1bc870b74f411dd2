"""The streamed hand-off between two real engines in one process: the prefill engine computes
its prompt in chunks and publishes each chunk's full blocks when the chunk's step ends, the
decode engine receives them meanwhile into blocks it allocated up front and emits the first
token once the last chunk landed. Faults mid-stream keep what arrived; nothing leaks."""

import time

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.config import KVTransferConfig

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NUM_BLOCKS = 64
CHUNK = 32  # the prefill engine's token budget: a ~200-token prompt takes 7 chunks


def _engine(loaded, role=None, transport="tcp"):
    kv = (
        KVTransferConfig(
            transport=transport, kv_role=role, kv_lease_timeout=30.0, kv_transfer_timeout=2.0
        )
        if role
        else None
    )
    config = EngineConfig.from_kwargs(
        dtype="float32",
        device="cpu",
        num_kv_blocks=NUM_BLOCKS,
        kv_transfer=kv,
        mode="chunked",
        max_num_batched_tokens=CHUNK,
    )
    return LLMEngine(config, loaded=loaded)


@pytest.fixture(scope="module")
def prompt(loaded_fp32):
    tokenizer = loaded_fp32.tokenizer
    return tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:203]


@pytest.fixture(scope="module")
def reference(loaded_fp32, prompt):
    engine = _engine(loaded_fp32)
    engine.add_request("ref", prompt, PARAMS)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    return tokens


def _start(prefill, decode, prompt):
    """Admit the streamed prefill leg, take its announced hand-off (its first step computes
    nothing: the decode leg starts before the first chunk), start the decode leg."""
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0), STREAMED)
    num_steps = prefill.get_stats().num_steps
    [announced] = prefill.step()
    assert prefill.get_stats().num_steps == num_steps
    hand_off = announced.kv_transfer_params
    assert hand_off["is_streamed"] and not hand_off["remote_block_ids"]
    assert not announced.new_token_ids and not announced.finished
    decode.add_request("d", prompt, PARAMS, hand_off)


STREAMED = {"do_remote_decode": True, "is_streamed": True}


def _drive(engines, until, timeout=60.0):
    """Step each engine in turn (as two processes would run side by side) until `until()`."""
    outputs = {id(e): [] for e in engines}
    deadline = time.monotonic() + timeout
    while not until(outputs):
        assert time.monotonic() < deadline, "no progress"
        for engine in engines:
            if engine.has_unfinished_requests():
                outputs[id(engine)] += engine.step()
    return outputs


def _finished(engine):
    return lambda outputs: any(o.finished for o in outputs[id(engine)])


def _all_free(*engines):
    for engine in engines:
        assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    return True


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_streamed_hand_off_equals_colocated(loaded_fp32, prompt, reference, transport):
    prefill = _engine(loaded_fp32, "kv_producer", transport)
    decode = _engine(loaded_fp32, "kv_consumer", transport)
    try:
        _start(prefill, decode, prompt)
        outputs = _drive([prefill, decode], _finished(decode))
        tokens = [t for o in outputs[id(decode)] for t in o.new_token_ids]
        assert tokens == reference
        [sampled] = [t for o in outputs[id(prefill)] for t in o.new_token_ids]
        assert sampled == reference[0]  # the decode engine emitted the prefill's token
        transfer = outputs[id(decode)][-1].kv_transfer
        assert transfer.error is None and transfer.num_kept_tokens is None
        assert 0 <= transfer.exposed_seconds <= transfer.seconds
        # The decode engine never computed the prompt: its first step is one token.
        _drive([prefill, decode], lambda _: not prefill.has_unfinished_requests())
        assert _all_free(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_prefill_gone_after_some_chunks_keeps_them(loaded_fp32, prompt, reference, monkeypatch):
    prefill = _engine(loaded_fp32, "kv_producer", "tcp")
    decode = _engine(loaded_fp32, "kv_consumer", "tcp")
    leases = prefill.kv_connector.connectors[0].transport.leases
    watched = _record_watches(monkeypatch, leases)
    try:
        _start(prefill, decode, prompt)
        for _ in range(3):  # three chunks, their full blocks published
            prefill.step()
        num_published = 3 * CHUNK // 16
        # Two WATCH rounds that knew every published block: the first one's answer (which
        # confirms the copies before it) reached the decode engine.
        deadline = time.monotonic() + 20
        while watched.count(num_published) < 2:
            assert time.monotonic() < deadline, f"decode side never caught up: {watched}"
            decode.step()
            time.sleep(0.01)
        prefill.shutdown()  # its KV server and leases go: the stream breaks off
        outputs = _drive([decode], _finished(decode))[id(decode)]
        tokens = [t for o in outputs for t in o.new_token_ids]
        assert tokens == reference
        transfer = outputs[-1].kv_transfer
        assert transfer.error is not None
        # The three chunks' whole blocks are kept; only the rest was computed here.
        assert transfer.num_kept_tokens == num_published * 16
        assert _all_free(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def _record_watches(monkeypatch, leases) -> list[int]:
    """`num_known` of every WATCH the prefill side answered."""
    seen = []
    real = leases.watch

    def watch(request_id, num_known, timeout):
        state = real(request_id, num_known, timeout)
        seen.append(num_known)
        return state

    monkeypatch.setattr(leases, "watch", watch)
    return seen


def test_decode_gone_mid_stream_frees_the_prefill_blocks_at_once(loaded_fp32, prompt):
    prefill = _engine(loaded_fp32, "kv_producer", "tcp")
    decode = _engine(loaded_fp32, "kv_consumer", "tcp")
    leases = prefill.kv_connector.connectors[0].transport.leases
    try:
        _start(prefill, decode, prompt)
        for _ in range(2):
            prefill.step()
            decode.step()
            time.sleep(0.05)  # the decode engine's receiver watches the stream meanwhile
        decode.shutdown()  # its connection to the prefill worker's KV server closes
        _drive([prefill], lambda _: not prefill.has_unfinished_requests(), timeout=20)
        # Well within the 30 s lease timeout: the lease ended with the request.
        assert leases.num_held_blocks == 0
        assert _all_free(prefill)
    finally:
        prefill.shutdown()
        decode.shutdown()
