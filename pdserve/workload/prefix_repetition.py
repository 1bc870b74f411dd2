"""`prefix-repetition`: a few shared system prompts, each reused by many requests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.workload.base import (
    BenchRequest,
    Workload,
    check_positive,
    fit_to_context,
)
from pdserve.workload.prompts import PromptSynthesizer

_SYSTEM_LEAD = "You are a helpful assistant. Follow these instructions carefully."


@dataclass(frozen=True)
class PrefixRepetitionWorkload(Workload):
    """`num_prefixes` shared prefixes of `prefix_len` tokens, each request one of them plus
    its own `input_len`-token question, so a prefix cache can serve all but the suffix.

    Words are joined by spaces, so a byte-level BPE tokenizes the shared prefix to the same
    ids in every request.
    """

    num_prompts: int = 100
    num_prefixes: int = 4
    prefix_len: int = 1024
    input_len: int = 128
    output_len: int = 128
    name = "prefix-repetition"

    def __post_init__(self) -> None:
        check_positive("--num-prompts", self.num_prompts)
        check_positive("--num-prefixes", self.num_prefixes)
        check_positive("--prefix-len", self.prefix_len)
        check_positive("--input-len", self.input_len)
        check_positive("--output-len", self.output_len)

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        total, output_len = fit_to_context(
            self.prefix_len + self.input_len, self.output_len, max_model_len
        )
        prefix_len = min(self.prefix_len, total - 1)
        prefixes = [synth.text(prefix_len, rng, _SYSTEM_LEAD) for _ in range(self.num_prefixes)]
        # Every prefix is used equally often, in a shuffled order.
        order = rng.permutation(np.arange(self.num_prompts) % self.num_prefixes)
        return [
            BenchRequest(synth.text(total, rng, prefixes[i]), total, output_len, f"prefix-{i}")
            for i in order
        ]
