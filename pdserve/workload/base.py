"""What a workload is: a list of requests plus the times they arrive."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pdserve.workload.arrivals import ArrivalProcess
from pdserve.workload.errors import BenchError
from pdserve.workload.prompts import PromptSynthesizer


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt text, which encodes to exactly `prompt_len` tokens, and the
    number of tokens to force out of the server (`max_tokens` with `ignore_eos`)."""

    prompt: str
    prompt_len: int
    output_len: int
    # A label for reports ("chat", "long-doc", ...).
    kind: str = "default"


class Workload:
    """Base of all workloads; subclasses are frozen dataclasses of their options.

    `build` makes the requests; `arrival_times` says when each is sent. The default arrival
    schedule applies the given process to requests in order; workloads with their own
    structure over time (trace replay, bursts) override it.
    """

    name: str = "workload"
    # Used when no --request-rate is given.
    default_request_rate: float = math.inf

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        raise NotImplementedError

    def arrival_times(
        self,
        requests: list[BenchRequest],
        request_rate: float | None,
        burstiness: float,
        rng: np.random.Generator,
    ) -> np.ndarray:
        """Seconds from the start at which each request is sent; shape [len(requests)]."""
        process = ArrivalProcess(self.resolve_rate(request_rate), burstiness)
        return process.sample(len(requests), rng)

    def phases(self, requests: list[BenchRequest]) -> list[list[int]] | None:
        """Groups of request indices to run one after another, each group sent at once when
        the one before has finished (a profile's measured points); None: every request at
        its arrival time."""
        return None

    def resolve_rate(self, request_rate: float | None) -> float | None:
        """The rate a run at `request_rate` (None: the default) actually uses."""
        return self.default_request_rate if request_rate is None else request_rate

    def describe(self) -> dict:
        """The workload's name and options, JSON-ready, for result files and reports."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        options = {f.name: _jsonable(getattr(self, f.name)) for f in fields}
        return {"name": self.name, **options}


def _jsonable(value):
    return value if isinstance(value, int | float | str | bool | None) else str(value)


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of token counts, drawn uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not (1 <= self.low <= self.high):
            raise BenchError(f"length range must satisfy 1 <= low <= high, got {self}")

    @classmethod
    def parse(cls, text: str, option: str) -> LengthRange:
        """Parse `N` or `LOW:HIGH`."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise BenchError(f"{option}: expected N or LOW:HIGH, got {text!r}") from None
        if len(values) not in (1, 2):
            raise BenchError(f"{option}: expected N or LOW:HIGH, got {text!r}")
        try:
            return cls(values[0], values[-1])
        except BenchError as exc:
            raise BenchError(f"{option}: {exc}") from None

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=size)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


def fit_to_context(prompt_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """Shorten the prompt (then the output) so that prompt + output fits the context."""
    if max_model_len is None or prompt_len + output_len <= max_model_len:
        return prompt_len, output_len
    if max_model_len < 2:
        raise BenchError(f"max_model_len {max_model_len} leaves no room for a request")
    output_len = min(output_len, max_model_len // 2)
    return max_model_len - output_len, output_len


def make_request(
    synth: PromptSynthesizer,
    rng: np.random.Generator,
    prompt_len: int,
    output_len: int,
    max_model_len: int | None,
    kind: str,
    lead: str = "",
) -> BenchRequest:
    """A request of random text, its lengths fitted to the context first.

    The lead-in is dropped when the prompt is too short to hold it and some words.
    """
    prompt_len, output_len = fit_to_context(int(prompt_len), int(output_len), max_model_len)
    if lead and synth.num_tokens(lead) * 2 > prompt_len:
        lead = ""
    return BenchRequest(synth.text(prompt_len, rng, lead), prompt_len, output_len, kind)


def check_positive(option: str, value: int) -> None:
    """Raise BenchError naming `option` unless `value` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise BenchError(f"{option} must be an integer >= 1, got {value!r}")
