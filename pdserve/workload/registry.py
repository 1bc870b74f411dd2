"""Workloads by name, built from the command line's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.workload.base import LengthRange, Workload
from pdserve.workload.errors import BenchError
from pdserve.workload.long_context import LongContextWorkload
from pdserve.workload.mixed import MixedWorkload
from pdserve.workload.prefix_repetition import PrefixRepetitionWorkload
from pdserve.workload.profile import ProfileWorkload
from pdserve.workload.random_lengths import RandomWorkload
from pdserve.workload.trace import TraceWorkload
from pdserve.workload.trace_file import TraceWindow, default_trace_path, load_trace


@dataclass(frozen=True)
class WorkloadOptions:
    """Every workload option the CLI takes; each workload reads the ones it knows.

    None means "the workload's default".
    """

    num_prompts: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0
    prefix_len: int | None = None
    num_prefixes: int | None = None
    long_fraction: float | None = None
    burst_size: int | None = None
    chat_input_len: LengthRange | None = None
    chat_output_len: LengthRange | None = None
    long_input_len: LengthRange | None = None
    long_output_len: LengthRange | None = None
    trace: str | None = None
    trace_window: TraceWindow = field(default_factory=TraceWindow)


def _given(**kwargs) -> dict:
    """Keyword arguments minus those left at None, so dataclass defaults apply."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _mixed(o: WorkloadOptions) -> Workload:
    return MixedWorkload(
        **_given(
            num_prompts=o.num_prompts,
            long_fraction=o.long_fraction,
            burst_size=o.burst_size,
            chat_input_len=o.chat_input_len,
            chat_output_len=o.chat_output_len,
            long_input_len=o.long_input_len,
            long_output_len=o.long_output_len,
        )
    )


def _random(o: WorkloadOptions) -> Workload:
    return RandomWorkload(
        range_ratio=o.range_ratio,
        **_given(num_prompts=o.num_prompts, input_len=o.input_len, output_len=o.output_len),
    )


def _prefix_repetition(o: WorkloadOptions) -> Workload:
    return PrefixRepetitionWorkload(
        **_given(
            num_prompts=o.num_prompts,
            num_prefixes=o.num_prefixes,
            prefix_len=o.prefix_len,
            suffix_len=o.input_len,
            output_len=o.output_len,
        )
    )


def _long_context(o: WorkloadOptions) -> Workload:
    return LongContextWorkload(
        **_given(
            num_prompts=o.num_prompts, input_len=o.long_input_len, output_len=o.long_output_len
        )
    )


def _trace(o: WorkloadOptions, rng: np.random.Generator) -> Workload:
    window = o.trace_window
    if window.num_prompts is None and window.duration_s is None:
        window = replace(window, num_prompts=o.num_prompts or 100)
    entries = load_trace(o.trace or default_trace_path())
    return TraceWorkload(tuple(window.select(entries, rng)))


def _profile(o: WorkloadOptions) -> Workload:
    lengths = None if o.input_len is None else _half_octaves_to(o.input_len)
    return ProfileWorkload(
        **_given(repeats=o.num_prompts, prompt_lens=lengths, decode_len=o.output_len)
    )


def _half_octaves_to(longest: int) -> tuple[int, ...]:
    """16, 64, then 128, 181, 256, ... (every half octave) up to `longest`, which ends it."""
    octaves = (round(2 ** (k / 2)) for k in range(14, 64))
    lengths = [n for n in (16, 64, *octaves) if n < longest]
    return (*lengths, longest)


_SIMPLE: dict[str, Callable[[WorkloadOptions], Workload]] = {
    "mixed": _mixed,
    "random": _random,
    "prefix-repetition": _prefix_repetition,
    "long-context": _long_context,
    "profile": _profile,
}
WORKLOAD_NAMES = (*_SIMPLE, "trace")


def make_workload(name: str, options: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """The workload called `name`; `rng` picks a random trace window when asked for one."""
    if name == "trace":
        return _trace(options, rng)
    if name not in _SIMPLE:
        raise BenchError(f"--workload: unknown {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    return _SIMPLE[name](options)
