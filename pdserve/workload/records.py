"""What the client saw of one request."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

# The error of a request a run did not send, or stopped waiting for, once the run's outcome
# (met or missed) could no longer change.
STOPPED_EARLY = "stopped early: the run's outcome was already decided"


@dataclass
class RequestRecord:
    """One request's observed timeline, in seconds since the benchmark started.

    `token_times` holds the arrival time of every content chunk (one per token, or per text
    piece when a server batches tokens). `num_output_tokens` comes from the usage chunk, or is
    the number of content chunks when the server sends no usage (`is_usage_reported` False).
    `server_extra` keeps whatever else the server reported (e.g. a TTFT breakdown in the
    usage chunk) as it arrived.
    """

    index: int
    kind: str
    prompt_len: int
    output_len: int
    arrival_time: float
    send_time: float | None = None
    end_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens_reported: int | None = None
    is_usage_reported: bool = False
    server_extra: dict = field(default_factory=dict)
    generated_text: str = ""
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        """Seconds from send to the first content chunk (successful requests only)."""
        return self.token_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        """Seconds from send to the last content chunk."""
        return self.token_times[-1] - self.send_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks, seconds."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """(E2EL − TTFT) / (output tokens − 1), None for one-token outputs."""
        if self.num_output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        return cls(**data)
