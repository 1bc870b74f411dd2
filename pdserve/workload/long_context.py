"""`long-context`: long documents to summarize, short answers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.workload.base import (
    BenchRequest,
    LengthRange,
    Workload,
    check_positive,
    make_request,
)
from pdserve.workload.prompts import PromptSynthesizer

DOCUMENT_LEAD = "Summarize the following document in a few sentences.\n\nDocument:"


@dataclass(frozen=True)
class LongContextWorkload(Workload):
    """Prompts of `long_input_len` tokens (a range) asking for a summary of `long_output_len`
    tokens (the mixed workload's long documents, alone)."""

    num_prompts: int = 10
    long_input_len: LengthRange = field(default_factory=lambda: LengthRange(4000, 6000))
    long_output_len: LengthRange = field(default_factory=lambda: LengthRange(64, 128))
    name = "long-context"

    def __post_init__(self) -> None:
        check_positive("--num-prompts", self.num_prompts)

    def build(
        self, synth: PromptSynthesizer, rng: np.random.Generator, max_model_len: int | None
    ) -> list[BenchRequest]:
        return long_documents(
            synth, rng, self.num_prompts, self.long_input_len, self.long_output_len, max_model_len
        )


def long_documents(
    synth: PromptSynthesizer,
    rng: np.random.Generator,
    num: int,
    input_len: LengthRange,
    output_len: LengthRange,
    max_model_len: int | None,
) -> list[BenchRequest]:
    """`num` summarize-this-document requests (kind "long-doc")."""
    prompt_lens = input_len.draw(rng, num)
    output_lens = output_len.draw(rng, num)
    return [
        make_request(synth, rng, p, o, max_model_len, "long-doc", DOCUMENT_LEAD)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]
