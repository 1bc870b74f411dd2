"""AsyncLLMEngine over the real LLMEngine (default model, float32, small KV cache)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.core.request import FinishReason
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    _Submission,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.config import KVTransferConfig

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 128
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture
def make_engine(loaded_fp32):
    def build(**kwargs) -> LLMEngine:
        config = EngineConfig.from_kwargs(
            dtype="float32", device="cpu", num_kv_blocks=NUM_KV_BLOCKS, **kwargs
        )
        return LLMEngine(config, loaded=loaded_fp32)

    return build


def run_async(engine: LLMEngine, body, **kwargs):
    """Run `body(async_engine)` on a fresh event loop with a started engine thread."""

    async def main():
        async_engine = AsyncLLMEngine(engine, **kwargs)
        async_engine.start()
        try:
            return await body(async_engine)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


async def collect(
    async_engine: AsyncLLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams = GREEDY,
):
    outputs = [out async for out in async_engine.generate(request_id, prompt, params)]
    tokens = [t for out in outputs for t in out.new_token_ids]
    return tokens, "".join(out.new_text for out in outputs), outputs[-1]


def sync_generate(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY):
    engine.add_request("sync", prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


async def wait_for_stats(async_engine: AsyncLLMEngine, predicate, max_steps: int = 50):
    """Wait (on engine heartbeats, not a timer) until predicate(stats) holds."""
    for _ in range(max_steps * 10):
        if predicate(async_engine.stats):
            return async_engine.stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine stats never satisfied the predicate: {async_engine.stats}")


def test_outputs_match_the_synchronous_engine(make_engine, chat_token_ids):
    expected = [sync_generate(make_engine(), p) for p in chat_token_ids[:3]]

    async def body(async_engine):
        results = await asyncio.gather(
            *(collect(async_engine, f"r{i}", p) for i, p in enumerate(chat_token_ids[:3]))
        )
        return results

    results = run_async(make_engine(), body)
    for (tokens, _, final), want in zip(results, expected, strict=True):
        assert tokens == want
        assert final.finished and final.num_output_tokens == len(want)
        assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_closing_the_iterator_aborts_within_one_step(make_engine, chat_token_ids):
    async def body(async_engine):
        generator = async_engine.generate("long", chat_token_ids[0], LONG)
        first = await generator.__anext__()
        assert first.new_token_ids and not first.finished
        steps_at_close = async_engine.stats.num_steps
        await generator.aclose()
        stats = await wait_for_stats(
            async_engine, lambda s: s.num_running == 0 and s.num_free_blocks == NUM_KV_BLOCKS
        )
        # The abort lands between steps: at most the step already running completes.
        assert stats.num_steps - steps_at_close <= 1
        # The id is free again and the engine keeps serving.
        tokens, _, _ = await collect(async_engine, "long", chat_token_ids[1])
        return tokens

    assert run_async(make_engine(), body)


def test_cancelled_consumer_aborts(make_engine, chat_token_ids):
    async def body(async_engine):
        async def consume():
            async for _ in async_engine.generate("c", chat_token_ids[0], LONG):
                pass

        task = asyncio.create_task(consume())
        await wait_for_stats(async_engine, lambda s: s.num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for_stats(
            async_engine, lambda s: s.num_running == 0 and s.num_free_blocks == NUM_KV_BLOCKS
        )

    run_async(make_engine(), body)


def test_invalid_request_is_rejected_at_admission(make_engine):
    async def body(async_engine):
        with pytest.raises(InvalidParameterError) as info:
            await async_engine.add_request("bad", [1] * (NUM_KV_BLOCKS * 16 + 5), GREEDY)
        assert info.value.param == "prompt"
        with pytest.raises(InvalidParameterError):
            await async_engine.add_request("empty", [], GREEDY)
        assert async_engine.is_healthy()
        tokens, _, _ = await collect(async_engine, "bad", [1, 2, 3])  # id reusable
        return tokens

    assert run_async(make_engine(), body)


def test_engine_exception_fails_requests_not_the_server(make_engine, chat_token_ids):
    engine = make_engine()
    real_step = engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward-pass failure")
        return real_step()

    engine.step = failing_once

    async def body(async_engine):
        with pytest.raises(RequestFailedError, match="injected"):
            await collect(async_engine, "victim", chat_token_ids[0], LONG)
        assert async_engine.is_healthy()
        await wait_for_stats(async_engine, lambda s: s.num_free_blocks == NUM_KV_BLOCKS)
        tokens, _, final = await collect(async_engine, "after", chat_token_ids[1])
        assert final.finished
        return tokens

    assert run_async(engine, body)


def test_admission_control_bounds_the_waiting_queue(make_engine, chat_token_ids):
    engine = make_engine()
    release = threading.Event()
    in_step = threading.Event()
    real_step = engine.step

    calls = {"n": 0}

    def held_step():
        # From the second step on (request "a" is running, nothing waits), a forward pass
        # that lasts until the test lets it go: no timers involved.
        calls["n"] += 1
        if calls["n"] >= 2:
            in_step.set()
            release.wait()
        return real_step()

    engine.step = held_step

    async def body(async_engine):
        first = await async_engine.add_request("a", chat_token_ids[0], GREEDY)
        await asyncio.to_thread(in_step.wait)
        # The engine thread is inside a step: new requests wait in the inbox.
        second = asyncio.create_task(async_engine.add_request("b", chat_token_ids[1], GREEDY))
        await asyncio.sleep(0)  # let it queue
        with pytest.raises(EngineOverloadedError) as info:
            await async_engine.add_request("c", chat_token_ids[2], GREEDY)
        assert info.value.retry_after_s >= 1
        release.set()
        second_stream = await second
        outs = [o async for o in first] + [o async for o in second_stream]
        first.close()
        second_stream.close()
        return outs

    outputs = run_async(engine, body, max_queue=1)
    assert sum(o.finished for o in outputs) == 2


def test_an_idle_engine_prefills_a_burst_in_one_step(make_engine, chat_token_ids):
    """A burst's first request does not start alone (the others' prefill would then stall its
    stream): the idle engine waits for the rest, and stops waiting when they fill a step (here
    its 3 seats), not on a timer (the gap is ten minutes)."""
    engine = make_engine(max_num_seqs=3)
    records = []
    engine.step_observers.append(records.append)

    async def body(async_engine):
        first = asyncio.create_task(collect(async_engine, "b0", chat_token_ids[0]))
        await asyncio.sleep(0.3)  # an engine that did not wait would be prefilling b0 alone
        rest = [collect(async_engine, f"b{i}", p) for i, p in enumerate(chat_token_ids[1:3], 1)]
        return await asyncio.wait_for(asyncio.gather(first, *rest), 120)

    results = run_async(engine, body, burst_gap_s=600.0)
    assert all(tokens for tokens, _, _ in results)
    first_step = records[0].batch
    # All three prompts, whole, each sampling its first token.
    assert [(new, is_sampling) for new, _, is_sampling in first_step] == [
        (len(p), True) for p in chat_token_ids[:3]
    ]


def test_a_lone_request_waits_one_burst_gap(make_engine, chat_token_ids):
    """The price of the burst gap: a request alone starts after it."""
    gap = 0.5

    async def body(async_engine):
        _, _, final = await collect(async_engine, "lone", chat_token_ids[0])
        return final.metrics

    metrics = run_async(make_engine(), body, burst_gap_s=gap)
    assert metrics.first_scheduled_time - metrics.arrival_time >= gap


def test_a_request_whose_kv_comes_from_elsewhere_is_not_held_for_a_burst(make_engine):
    """Its prefill ran on another worker: there is nothing to share, so the idle engine does
    not wait (a ten-minute gap would otherwise hold the gathering past the join below)."""
    async_engine = AsyncLLMEngine(make_engine(), burst_gap_s=600.0)
    async_engine._new.append(
        _Submission(None, [1, 2, 3], GREEDY, {"do_remote_prefill": True}, time.monotonic())
    )
    gathering = threading.Thread(target=async_engine._gather_burst, daemon=True)
    gathering.start()
    gathering.join(60)
    assert not gathering.is_alive()


def test_kv_transfer_params_reach_the_engine_and_come_back(loaded_fp32, chat_token_ids):
    kv = KVTransferConfig(
        transport="shm", kv_role="kv_producer", kv_lease_timeout=10.0, kv_transfer_timeout=2.0
    )
    config = EngineConfig.from_kwargs(
        dtype="float32", device="cpu", num_kv_blocks=NUM_KV_BLOCKS, kv_transfer=kv
    )
    prefill = LLMEngine(config, loaded=loaded_fp32)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    async def body(async_engine):
        stream = await async_engine.add_request(
            "kv", chat_token_ids[0], one_token, kv_transfer_params={"do_remote_decode": True}
        )
        outputs = [o async for o in stream]
        stream.close()
        return outputs

    outputs = run_async(prefill, body)  # the engine thread shuts the transport down
    params = outputs[-1].kv_transfer_params
    assert params["do_remote_prefill"]
    assert params["first_token_id"] == outputs[-1].new_token_ids[0]


def test_kv_transfer_params_rejected_by_a_plain_engine(make_engine):
    async def body(async_engine):
        with pytest.raises(InvalidParameterError) as info:
            await async_engine.add_request(
                "kv", [1, 2, 3], GREEDY, kv_transfer_params={"do_remote_decode": True}
            )
        assert info.value.param == "kv_transfer_params"

    run_async(make_engine(), body)


def test_shutdown_aborts_in_flight_with_a_final_output(make_engine, chat_token_ids):
    async def body(async_engine):
        stream = await async_engine.add_request("s", chat_token_ids[0], LONG)
        first = await stream.__anext__()
        async_engine.begin_shutdown(grace_s=0.0)
        rest = [o async for o in stream]
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("late", [1, 2], GREEDY)
        assert not async_engine.is_healthy()
        return first, rest

    first, rest = run_async(make_engine(), body)
    final = rest[-1]
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert final.num_output_tokens == 1 + sum(len(o.new_token_ids) for o in rest)
    assert first.num_prompt_tokens == final.num_prompt_tokens


def test_idle_engine_keeps_a_heartbeat(make_engine):
    async def body(async_engine):
        beat = async_engine.stats.heartbeat
        await wait_for_stats(async_engine, lambda s: s.heartbeat > beat)
        assert async_engine.is_healthy()
        assert not async_engine.is_healthy(timeout_s=1e-9)

    run_async(make_engine(), body)


def test_a_broken_engine_loop_fails_requests_and_health(make_engine, chat_token_ids):
    engine = make_engine()

    def broken(*_args):
        raise RuntimeError("cannot even abort")

    engine.step = broken  # the step fails, and so does the clean-up after it
    engine.abort_request = broken

    async def body(async_engine):
        with pytest.raises(EngineDeadError, match="cannot even abort"):
            await collect(async_engine, "doomed", chat_token_ids[0])
        assert not async_engine.is_healthy()
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("late", [1, 2], GREEDY)

    run_async(engine, body)
