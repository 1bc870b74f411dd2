"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=tests.server.schemathesis_hooks``) for the
conformance runs in `openapi_conformance`.

The published document states every rule a body can break whatever model is served; the
rules that depend on the model or compare two fields (the context window, the vocabulary,
min_tokens <= max_tokens) are in its descriptions, which no JSON Schema generator reads.
So schema-valid bodies are brought within them here, and only those: bodies generated to be
invalid are left alone. Generation stays short (a few tokens) and seeded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

from pdserve.server.inputs import DEFAULT_COMPLETION_MAX_TOKENS

# Set by the test from the served model (`openapi_conformance.ENV_*`).
VOCAB_SIZE = int(os.environ.get("PDSERVE_TEST_VOCAB_SIZE", "49152"))
# Bytes of prompt (text or ids) a body may carry; each token takes at least one byte.
MAX_PROMPT_BYTES = int(os.environ.get("PDSERVE_TEST_MAX_PROMPT_BYTES", "512"))
MAX_NEW_TOKENS = 4
SEED = 0


# Workers the run must leave serving (a router's drain stops a worker its launcher started).
KEPT_WORKERS = set(filter(None, os.environ.get("PDSERVE_TEST_KEPT_WORKERS", "").split(",")))


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """Drop the rare valid body whose prompt could overflow the context window, and any
    drain or role switch of a kept worker."""
    if (case.path_parameters or {}).get("worker_id") in KEPT_WORKERS:
        return False
    body = case.body
    if not _is_valid_generation(case) or not isinstance(body, dict):
        return True
    prompt = body.get("messages", body.get("prompt"))
    return len(json.dumps(prompt, ensure_ascii=False).encode()) <= MAX_PROMPT_BYTES


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    if _is_valid_generation(case) and isinstance(case.body, dict):
        _within_model(case.body)
    return case


def _is_valid_generation(case: schemathesis.Case) -> bool:
    return (
        case.path in ("/v1/completions", "/v1/chat/completions")
        and case.meta is not None
        and case.meta.generation.mode.is_positive
    )


def _within_model(body: dict[str, Any]) -> None:
    is_chat = "messages" in body
    for key in ("max_tokens", "max_completion_tokens"):
        if _is_number(body.get(key)):
            body[key] = min(body[key], MAX_NEW_TOKENS)
    limit = body.get("max_completion_tokens") if is_chat else None
    if limit is None:
        limit = body.get("max_tokens")
    if limit is None and is_chat:  # it would generate to the end of the context
        limit = body["max_tokens"] = MAX_NEW_TOKENS
    elif limit is None:
        limit = DEFAULT_COMPLETION_MAX_TOKENS
    if _is_number(body.get("min_tokens")):
        body["min_tokens"] = min(body["min_tokens"], limit)
    body.setdefault("seed", SEED)
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = [_in_vocab(t) for t in body["stop_token_ids"]]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [
            [_in_vocab(t) for t in p] if isinstance(p, list) else _in_vocab(p) for p in prompt
        ]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _in_vocab(token: Any) -> Any:
    return int(token) % VOCAB_SIZE if _is_number(token) else token
