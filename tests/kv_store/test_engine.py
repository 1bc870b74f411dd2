"""Two engines on the real SmolLM2 weights share a KV store: the second computes only its
prompt's suffix, and its greedy output equals an engine's without the store."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_store import KVStoreConfig
from pdserve.model.loader import load_model

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype="float32", device="cpu")


def _engine(loaded, kv_store: KVStoreConfig | None) -> LLMEngine:
    config = EngineConfig.from_kwargs(
        dtype="float32", device="cpu", num_kv_blocks=96, kv_store=kv_store
    )
    return LLMEngine(config, loaded=loaded)


def _run(engine: LLMEngine, prompt: list[int]):
    """Greedy tokens, prompt tokens computed by the model, and the final output."""
    num_computed = []
    engine.step_observers.append(lambda record: num_computed.append(record.batch))
    engine.add_request("r", prompt, GREEDY)
    tokens, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            final = output if output.finished else final
    prefill = sum(n for batch in num_computed for n, _, samples in batch if not samples or n > 1)
    return tokens, prefill, final


def test_second_engine_reads_the_shared_prefix(loaded, tmp_path):
    tokenizer = loaded.tokenizer
    prefix = tokenizer.encode("You are a careful assistant. " * 40)  # ~240 tokens
    first_prompt = prefix + tokenizer.encode(" Question: what is two plus two?")
    second_prompt = prefix + tokenizer.encode(" Question: name a colour of the sky.")
    store = KVStoreConfig(f"local:{tmp_path}", max_gb=0.5)

    writer = _engine(loaded, store)
    _run(writer, first_prompt)
    [store_connector] = writer.kv_connector.connectors
    assert store_connector.store.flush()
    reader = _engine(loaded, store)
    tokens, prefill, final = _run(reader, second_prompt)
    reference, reference_prefill, _ = _run(_engine(loaded, None), second_prompt)

    assert tokens == reference  # the store changes nothing but the work done
    num_shared = len(prefix) // 16 * 16
    assert final.kv_store is not None and final.kv_store.num_hit_tokens >= num_shared
    assert prefill <= reference_prefill - num_shared
    for engine in (writer, reader):
        manager = engine.scheduler.block_manager
        assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
        engine.shutdown()
