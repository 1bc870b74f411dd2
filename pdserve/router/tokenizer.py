"""Prompt token ids for routing, from a worker's ``POST /tokenize``.

The router imports no model code (no torch): the worker that will run the prompt tokenizes it
with the same tokenizer and chat template, so the ids match the ones its block manager hashes.
Any failure yields None and routing falls back to a length estimate.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from pdserve.router.pool import WorkerRegistry
from pdserve.router.prompt import tokenize_request_body
from pdserve.router.worker import Worker

logger = logging.getLogger("pdserve.router")

# Workers tried per request before giving up on exact token ids.
_MAX_TRIES = 2


class RemoteTokenizer:
    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient,
                 timeout_s: float) -> None:
        self.registry = registry
        self.client = client
        self.timeout_s = timeout_s
        self._has_warned = False

    async def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        request = tokenize_request_body(endpoint, body)
        if request is None:
            return None
        for worker in self._candidates()[:_MAX_TRIES]:
            try:
                response = await self.client.post(f"{worker.url}/tokenize", json=request,
                                                  timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                self._warn(f"{worker.url}/tokenize failed: {type(exc).__name__}: {exc}")
                continue
            if response.status_code == 404:
                self._warn(f"{worker.url} has no POST /tokenize")
            # Another 4xx means the request itself is bad: the worker will say so on the leg.
            return _tokens_from(response) if response.status_code == 200 else None
        return None

    def _candidates(self) -> list[Worker]:
        """Least busy prefill workers first (tokenizing there keeps decode cores free)."""
        key = lambda w: w.num_inflight  # noqa: E731
        return (sorted(self.registry.prefill.routable(), key=key)
                + sorted(self.registry.decode.routable(), key=key))

    def _warn(self, message: str) -> None:
        if not self._has_warned:
            logger.warning("%s; routing on estimated prompt lengths", message)
            self._has_warned = True


def _tokens_from(response: httpx.Response) -> list[int] | None:
    try:
        tokens = response.json().get("tokens")
    except (ValueError, AttributeError):
        return None
    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
        return tokens
    return None
