"""Shared engine fixtures: the default model in float32, loaded once per session."""

from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.loader import load_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]


@pytest.fixture(scope="session")
def loaded_fp32():
    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def make_llm(loaded_fp32):
    """Build an `LLM` over the already-loaded default model with any engine settings."""
    from pdserve.engine.config import EngineConfig

    def build(**kwargs) -> LLM:
        config = EngineConfig.from_kwargs(dtype="float32", device="cpu", **kwargs)
        return LLM(engine=LLMEngine(config, loaded=loaded_fp32))

    return build


@pytest.fixture(scope="session")
def chat_token_ids(loaded_fp32):
    tokenizer = loaded_fp32.tokenizer
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        for p in CHAT_PROMPTS
    ]
