"""POST /tokenize (vLLM's shape): the prompt token ids a generation request would compute.

``{"prompt": str}`` or ``{"messages": [...], "add_generation_prompt": bool}`` (plus an optional
``model``) answers ``{"tokens": [...], "count": n, "max_model_len": m}``. The ids come from
the same code as /v1/completions and /v1/chat/completions, so a router can hash them into
the same prefix-cache blocks the worker will. Unlike generation, a prompt longer than the
context window is not an error here: the caller learns its length.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pdserve.server.errors import invalid
from pdserve.server.inputs import ModelInfo, chat_prompt_ids, check_model
from pdserve.server.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    """Exactly one of `prompt` and `messages`."""

    # The generation endpoints' rules: strict types, unknown fields ignored.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True


def tokenize(body: TokenizeRequest, info: ModelInfo) -> dict:
    check_model(body.model, info)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("prompt", "give exactly one of prompt and messages")
    if body.messages is not None:
        ids = chat_prompt_ids(body.messages, body.add_generation_prompt, info)
    else:
        ids = info.tokenizer.encode(body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len}


def add_tokenize_route(app: FastAPI, info: ModelInfo) -> None:
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict:
        return await asyncio.to_thread(tokenize, body, info)
