"""`trace`: replay recorded arrivals and lengths."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pdserve.workload.base import BenchRequest, Workload, fit_to_context, make_request
from pdserve.workload.errors import BenchError
from pdserve.workload.prompts import PromptSynthesizer
from pdserve.workload.trace_file import TraceEntry


@dataclass(frozen=True)
class TraceWorkload(Workload):
    """Requests from trace entries (already windowed, see `TraceWindow`).

    Arrivals follow the trace's own timestamps when no request rate is given; a finite rate
    rescales them to that mean rate (same shape, different speed); `inf` sends all at once.
    """

    entries: tuple[TraceEntry, ...] = field(repr=False)
    name = "trace"

    def __post_init__(self) -> None:
        if not self.entries:
            raise BenchError("the trace has no requests")

    def describe(self) -> dict:
        span = self.entries[-1].timestamp - self.entries[0].timestamp
        return {"name": self.name, "num_prompts": len(self.entries), "span_s": span}

    def resolve_rate(self, request_rate: float | None) -> float | None:
        # None stays None: the trace's own pace.
        return request_rate

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        return [self._request(e, synth, rng, max_model_len) for e in self.entries]

    def arrival_times(
        self,
        requests: list[BenchRequest],
        request_rate: float | None,
        burstiness: float,
        rng: np.random.Generator,
    ) -> np.ndarray:
        times = np.array([e.timestamp for e in self.entries])
        if request_rate is None:
            return times
        if math.isinf(request_rate) or times[-1] == 0.0:
            return np.zeros(len(times))
        traced_rate = (len(times) - 1) / times[-1]
        return times * (traced_rate / request_rate)

    @staticmethod
    def _request(
        entry: TraceEntry,
        synth: PromptSynthesizer,
        rng: np.random.Generator,
        max_model_len: int | None,
    ) -> BenchRequest:
        if entry.prompt is None:
            return make_request(
                synth, rng, entry.prompt_len, entry.output_len, max_model_len, "trace"
            )
        ids = synth.tokenizer.encode(entry.prompt)
        prompt_len, output_len = fit_to_context(len(ids), entry.output_len, max_model_len)
        prompt = entry.prompt
        if prompt_len < len(ids):
            # Cut to fit; re-encoding the cut text may shift the count at the seam, so count it.
            prompt = synth.tokenizer.decode(ids[:prompt_len])
            prompt_len = synth.num_tokens(prompt)
        return BenchRequest(prompt, prompt_len, output_len, "trace")
