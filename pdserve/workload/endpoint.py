"""`EndpointConfig`: where a benchmark run's requests go and how they are spelled (the OpenAI
completions or chat endpoint, the body each request becomes). A result keeps it as part of
its description; the simulator names the one it stands in for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.workload.base import BenchRequest
from pdserve.workload.errors import BenchError

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    # Whole-request limit in seconds; connecting has its own short one.
    request_timeout_s: float = 3600.0
    # Merged into every request body (e.g. {"top_k": 1}).
    extra_body: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchError(
                f"--base-url must start with http:// or https://, got {self.base_url!r}"
            )
        if self.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            raise BenchError(
                f"--endpoint must be {COMPLETIONS} or {CHAT_COMPLETIONS}, got {self.endpoint!r}"
            )
        if not self.request_timeout_s > 0:
            raise BenchError(f"--timeout must be > 0, got {self.request_timeout_s}")

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_COMPLETIONS

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def payload(self, request: BenchRequest, model: str) -> dict:
        """The request body: streamed, usage included, exactly `output_len` tokens forced."""
        body: dict = {
            "model": model,
            "max_tokens": request.output_len,
            "ignore_eos": True,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return {**body, **self.extra_body}
