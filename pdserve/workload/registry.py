"""Workloads by name, built from the command line's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

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
    """Every workload option the CLI takes (`flags.WORKLOAD_FLAGS`, same names); each
    workload reads the ones it has a field of the same name for.

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


def _from_options(workload_type: type[Workload], o: WorkloadOptions, **derived) -> Workload:
    """A `workload_type` whose every field an option names takes that option (same name);
    options left at None leave the workload's default."""
    given = {f.name: getattr(o, f.name) for f in fields(workload_type) if f.name in _OPTIONS}
    given.update(derived)
    return workload_type(**{k: v for k, v in given.items() if v is not None})


def _trace(o: WorkloadOptions, rng: np.random.Generator) -> Workload:
    window = o.trace_window
    if window.num_prompts is None and window.duration_s is None:
        window = replace(window, num_prompts=o.num_prompts or 100)
    entries = load_trace(o.trace or default_trace_path())
    return TraceWorkload(tuple(window.select(entries, rng)))


def _profile(o: WorkloadOptions) -> Workload:
    # --input-len is the longest prompt profiled; the lengths up to it are half octaves.
    lengths = None if o.input_len is None else _half_octaves_to(o.input_len)
    return _from_options(ProfileWorkload, o, prompt_lens=lengths)


def _half_octaves_to(longest: int) -> tuple[int, ...]:
    """16, 64, then 128, 181, 256, ... (every half octave) up to `longest`, which ends it."""
    octaves = (round(2 ** (k / 2)) for k in range(14, 64))
    lengths = [n for n in (16, 64, *octaves) if n < longest]
    return (*lengths, longest)


_OPTIONS = frozenset(f.name for f in fields(WorkloadOptions))
# The workloads built from their options by name alone (`_from_options`), or by a builder.
_SIMPLE: dict[str, Callable[[WorkloadOptions], Workload]] = {
    "mixed": lambda o: _from_options(MixedWorkload, o),
    "random": lambda o: _from_options(RandomWorkload, o),
    "prefix-repetition": lambda o: _from_options(PrefixRepetitionWorkload, o),
    "long-context": lambda o: _from_options(LongContextWorkload, o),
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
