"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOKENS_LIMIT = 1_000_000
# Temperatures below this sample as greedy: dividing logits by them overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    temperature 0 means greedy. top_k None (or 0) and top_p 1.0 disable those filters.
    `stop` strings end the output before the match (the match is not returned).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists and a bare string from callers; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", None)
        self._validate()

    def _validate(self) -> None:
        _require(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
            "max_tokens",
            "must be an integer",
        )
        _require(
            1 <= self.max_tokens <= MAX_TOKENS_LIMIT,
            "max_tokens",
            f"must be between 1 and {MAX_TOKENS_LIMIT}, got {self.max_tokens}",
        )
        _require(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            f"must be between 0 and 2, got {self.temperature}",
        )
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(
            self.top_k is None or self.top_k >= 1,
            "top_k",
            f"must be at least 1 (or 0/None to disable), got {self.top_k}",
        )
        _require(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        _require(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"must be between 0 and 20, got {self.logprobs}",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidParameterError(param, message)
