"""Token-level stopping: every EOS id of the model ends a request."""

import dataclasses

from pdserve.core.request import FinishReason
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine


def test_every_eos_id_of_the_model_stops_generation(loaded_fp32, chat_token_ids):
    """Models such as Llama-3 instruct end turns with one of several EOS ids."""

    def generate(loaded):
        engine = LLMEngine(EngineConfig.from_kwargs(dtype="float32", device="cpu"), loaded)
        return LLM(engine=engine).generate(
            [chat_token_ids[0]], SamplingParams(max_tokens=6), use_tqdm=False
        )[0]

    plain = generate(loaded_fp32)
    assert len(plain.token_ids) == 6 and plain.finish_reason is FinishReason.LENGTH
    # Declare the model's third greedy token an EOS id, beside its own.
    config = dataclasses.replace(
        loaded_fp32.config, eos_token_ids=(*loaded_fp32.config.eos_token_ids, plain.token_ids[2])
    )
    stopped = generate(dataclasses.replace(loaded_fp32, config=config))
    assert stopped.token_ids == plain.token_ids[:3]
    assert stopped.finish_reason is FinishReason.STOP


def test_abort_returns_the_final_output_with_the_engines_counts(make_llm):
    engine = make_llm(mode="chunked").engine
    engine.add_request("a", list(range(100, 120)), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    final = engine.abort_request("a")
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert (final.num_prompt_tokens, final.num_output_tokens) == (20, 3)
    assert final.metrics.finished_time is not None
    assert engine.abort_request("a") is None  # no longer in flight
    assert not engine.has_unfinished_requests()
