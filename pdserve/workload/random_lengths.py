"""`random`: random text with lengths spread around a centre by a range ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.workload.base import BenchRequest, Workload, check_positive, make_request
from pdserve.workload.errors import BenchError
from pdserve.workload.prompts import PromptSynthesizer


@dataclass(frozen=True)
class RandomWorkload(Workload):
    """Prompt and output lengths uniform in [len·(1−r), len·(1+r)], r = `range_ratio`."""

    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    name = "random"

    def __post_init__(self) -> None:
        check_positive("--num-prompts", self.num_prompts)
        check_positive("--input-len", self.input_len)
        check_positive("--output-len", self.output_len)
        if not 0.0 <= self.range_ratio < 1.0:
            raise BenchError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        prompt_lens = _spread(self.input_len, self.range_ratio, rng, self.num_prompts)
        output_lens = _spread(self.output_len, self.range_ratio, rng, self.num_prompts)
        return [
            make_request(synth, rng, p, o, max_model_len, "random")
            for p, o in zip(prompt_lens, output_lens, strict=True)
        ]


def _spread(centre: int, ratio: float, rng: np.random.Generator, size: int) -> np.ndarray:
    low = max(1, math.floor(centre * (1 - ratio)))
    high = max(low, math.ceil(centre * (1 + ratio)))
    return rng.integers(low, high + 1, size=size)
