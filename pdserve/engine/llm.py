"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from pdserve.core.request import FinishReason
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import TokenLogprob

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class GenerationResult:
    """One finished generation."""

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None


class LLM:
    """Run many prompts through one engine with continuous batching.

    `engine_kwargs` are `EngineConfig.from_kwargs`'s flat names, e.g. `LLM(mode="colocated",
    max_num_seqs=8, num_kv_blocks=256)`.
    """

    def __init__(
        self, model: str | None = None, *, engine: LLMEngine | None = None, **engine_kwargs
    ) -> None:
        self.engine = engine or LLMEngine.from_args(model=model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(engine=LLMEngine(config))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        """Generate for each prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._encode(p) for p in prompts]
        return self._run(token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True)
            for c in conversations
        ]
        return self._run([self._encode(p) for p in prompts], sampling_params, use_tqdm)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidParameterError("prompt", "must be a string or a list of token ids")

    def _run(self, token_lists: list[list[int]], sampling_params, use_tqdm: bool):
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(token_lists)
        if len(sampling_params) != len(token_lists):
            raise InvalidParameterError("sampling_params", "must match the number of prompts")
        order = []
        for tokens, params in zip(token_lists, sampling_params, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, tokens, params)
            order.append((request_id, tokens))
        results = self._drain(len(order), use_tqdm)
        for request_id, tokens in order:
            results[request_id].prompt_token_ids = tokens
        return [results[rid] for rid, _ in order]

    def _drain(self, num_requests: int, use_tqdm: bool) -> dict[str, GenerationResult]:
        partial: dict[str, GenerationResult] = {}
        done: dict[str, GenerationResult] = {}
        with tqdm(total=num_requests, desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = partial.setdefault(
                        out.request_id,
                        GenerationResult(
                            [],
                            "",
                            [],
                            None,
                            out.num_cached_tokens,
                            [] if out.logprobs is not None else None,
                        ),
                    )
                    result.text += out.new_text
                    result.token_ids += out.new_token_ids
                    if out.logprobs is not None:
                        result.logprobs += out.logprobs
                    if out.finished:
                        result.finish_reason = out.finish_reason
                        done[out.request_id] = partial.pop(out.request_id)
                        bar.update(1)
        return done
