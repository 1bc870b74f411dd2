"""`mixed` (the default): steady interactive chat plus bursts of long documents.

This is the traffic that exposes phase interference: every long prefill that shares a step
with running chat streams stalls their next tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pdserve.workload.arrivals import ArrivalProcess
from pdserve.workload.base import (
    BenchRequest,
    LengthRange,
    Workload,
    check_positive,
    make_request,
)
from pdserve.workload.errors import BenchError
from pdserve.workload.long_context import long_documents
from pdserve.workload.prompts import PromptSynthesizer

CHAT = "chat"


@dataclass(frozen=True)
class MixedWorkload(Workload):
    """Chat requests (short prompts, `chat_output_len` tokens out) arriving at the request
    rate, plus a `long_fraction` share of long-document requests arriving `burst_size` at a
    time, the bursts spread evenly over the chat traffic's span."""

    num_prompts: int = 40
    long_fraction: float = 0.1
    burst_size: int = 2
    chat_input_len: LengthRange = field(default_factory=lambda: LengthRange(32, 256))
    chat_output_len: LengthRange = field(default_factory=lambda: LengthRange(128, 512))
    long_input_len: LengthRange = field(default_factory=lambda: LengthRange(4000, 6000))
    long_output_len: LengthRange = field(default_factory=lambda: LengthRange(64, 128))
    name = "mixed"
    default_request_rate = 1.0

    def __post_init__(self) -> None:
        check_positive("--num-prompts", self.num_prompts)
        check_positive("--burst-size", self.burst_size)
        if not 0.0 <= self.long_fraction <= 1.0:
            raise BenchError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")

    @property
    def num_long(self) -> int:
        return round(self.num_prompts * self.long_fraction)

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        num_chat = self.num_prompts - self.num_long
        chat = [
            make_request(synth, rng, p, o, max_model_len, CHAT)
            for p, o in zip(
                self.chat_input_len.draw(rng, num_chat),
                self.chat_output_len.draw(rng, num_chat),
                strict=True,
            )
        ]
        docs = long_documents(
            synth, rng, self.num_long, self.long_input_len, self.long_output_len, max_model_len
        )
        return chat + docs

    def arrival_times(
        self,
        requests: list[BenchRequest],
        request_rate: float | None,
        burstiness: float,
        rng: np.random.Generator,
    ) -> np.ndarray:
        rate = self.resolve_rate(request_rate)
        is_chat = np.array([r.kind == CHAT for r in requests], dtype=bool)
        times = np.zeros(len(requests))
        times[is_chat] = ArrivalProcess(rate, burstiness).sample(int(is_chat.sum()), rng)
        num_docs = int((~is_chat).sum())
        if math.isinf(rate) or num_docs == 0:
            return times
        # The chat span, or what it would be at this rate when there is (almost) no chat.
        span = max(times[is_chat].max(initial=0.0), (len(requests) - 1) / rate)
        num_bursts = math.ceil(num_docs / self.burst_size)
        burst_of_doc = np.arange(num_docs) // self.burst_size
        times[~is_chat] = span * (burst_of_doc + 1) / (num_bursts + 1)
        return times
