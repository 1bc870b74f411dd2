"""What routing knows about a prompt: its length and its full blocks' chained hashes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.core.block_manager import BlockHash
from pdserve.router.prefix_index import prompt_block_hashes

# Rough bytes of text per token for English BPE vocabularies; used only when the prompt could
# not be tokenized, to weigh prefill load.
_BYTES_PER_TOKEN_ESTIMATE = 4


@dataclass(frozen=True)
class PromptInfo:
    num_tokens: int
    # Empty when the token ids are unknown (then nothing is believed cached anywhere).
    block_hashes: tuple[BlockHash, ...] = ()
    # Whether `num_tokens` is exact (tokenized) rather than estimated from the text length.
    is_exact: bool = False

    @classmethod
    def from_token_ids(cls, token_ids: Sequence[int], block_size: int) -> PromptInfo:
        return cls(len(token_ids), tuple(prompt_block_hashes(token_ids, block_size)), True)

    @classmethod
    def estimate(cls, body: dict[str, Any]) -> PromptInfo:
        """Length guessed from the prompt or messages' JSON size; no block hashes."""
        source = body.get("messages", body.get("prompt", ""))
        num_bytes = len(json.dumps(source, ensure_ascii=False).encode())
        return cls(max(1, num_bytes // _BYTES_PER_TOKEN_ESTIMATE))


def literal_token_ids(body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids when a completions request gives them directly (OpenAI allows
    `prompt` as a list of ints, or a one-element list of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    return None


def tokenize_request_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The body of a worker's ``POST /tokenize`` (vLLM's shape) for this request, or None when
    the request has nothing a tokenizer can take (e.g. a batch of prompts)."""
    model = body.get("model")
    if endpoint.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        request = {
            "messages": messages,
            "add_generation_prompt": body.get("add_generation_prompt", True),
        }
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            return None
        request = {"prompt": prompt}
    if model is not None:
        request["model"] = model
    return request
