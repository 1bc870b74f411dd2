"""The workload's command-line options, declared once: `pdserve bench` and `pdserve simulate`
take the same `WORKLOAD_FLAGS` and turn them into the same `WorkloadOptions`
(`workload_options`); `bench convert-trace` takes the trace window's alone."""

from __future__ import annotations

import argparse
from dataclasses import fields

from pdserve.flags import flag
from pdserve.workload.base import LengthRange
from pdserve.workload.errors import BenchError
from pdserve.workload.registry import WORKLOAD_NAMES, WorkloadOptions
from pdserve.workload.trace_file import TraceWindow, default_trace_path

TRACE_WINDOW_FLAGS = (
    flag(
        "--trace-window-start",
        default="0",
        metavar="SECONDS|random",
        help="trace: where the replayed window starts",
    ),
    flag("--trace-duration", type=float, help="trace: window length, seconds"),
    flag(
        "--trace-time-scale",
        type=float,
        default=1.0,
        help="trace: multiply timestamps (2 = half speed)",
    ),
    flag("--trace-max-input-len", type=int, help="trace: clip prompt lengths"),
    flag("--trace-max-output-len", type=int, help="trace: clip output lengths"),
)
# `WorkloadOptions`' fields that are N or LOW:HIGH token ranges, with what each is.
_RANGES = {
    "chat_input_len": "mixed: chat prompt tokens",
    "chat_output_len": "mixed: chat output tokens",
    "long_input_len": "mixed, long-context: document tokens",
    "long_output_len": "mixed, long-context: summary tokens",
}
WORKLOAD_FLAGS = (
    flag("--workload", default="mixed", choices=WORKLOAD_NAMES),
    flag("--num-prompts", type=int, help="requests per run (default: per workload)"),
    flag(
        "--input-len",
        type=int,
        help="random: prompt tokens; prefix-repetition: tokens after the shared prefix",
    ),
    flag("--output-len", type=int, help="random, prefix-repetition: output tokens"),
    flag("--range-ratio", type=float, default=0.0, help="random: length spread"),
    flag("--prefix-len", type=int, help="prefix-repetition: shared prefix tokens"),
    flag("--num-prefixes", type=int, help="prefix-repetition: distinct prefixes"),
    flag("--long-fraction", type=float, help="mixed: share of long documents"),
    flag("--burst-size", type=int, help="mixed: long documents per burst"),
    *(
        flag(f"--{name.replace('_', '-')}", metavar="LOW:HIGH", help=f"{what} (N or LOW:HIGH)")
        for name, what in _RANGES.items()
    ),
    flag("--trace", help=f"trace: JSONL or Azure CSV (default: {default_trace_path()})"),
    *TRACE_WINDOW_FLAGS,
)


def trace_window(args: argparse.Namespace, num_prompts: int | None = None) -> TraceWindow:
    """The window of the trace `TRACE_WINDOW_FLAGS` give (`num_prompts`: its first N)."""
    start = args.trace_window_start
    if start == "random":
        start_s = None
    else:
        try:
            start_s = float(start)
        except ValueError:
            raise BenchError(
                f"--trace-window-start: expected seconds or 'random', got {start!r}"
            ) from None
    return TraceWindow(
        start_s=start_s,
        num_prompts=num_prompts,
        duration_s=args.trace_duration,
        time_scale=args.trace_time_scale,
        max_input_len=args.trace_max_input_len,
        max_output_len=args.trace_max_output_len,
    )


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    """`WorkloadOptions` from `WORKLOAD_FLAGS`: each field is its flag's (same name)."""
    values = {
        option.name: getattr(args, option.name)
        for option in fields(WorkloadOptions)
        if option.name not in ("trace_window", *_RANGES)
    }
    for name in _RANGES:
        text = getattr(args, name)
        flag_name = "--" + name.replace("_", "-")
        values[name] = None if text is None else LengthRange.parse(text, flag_name)
    return WorkloadOptions(**values, trace_window=trace_window(args))
