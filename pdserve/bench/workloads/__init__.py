"""Benchmark workloads: requests of exact token lengths, reproducible from a seed."""

from pdserve.bench.workloads.base import BenchRequest, LengthRange, Workload
from pdserve.bench.workloads.long_context import LongContextWorkload
from pdserve.bench.workloads.mixed import MixedWorkload
from pdserve.bench.workloads.prefix_repetition import PrefixRepetitionWorkload
from pdserve.bench.workloads.random_lengths import RandomWorkload
from pdserve.bench.workloads.registry import WORKLOAD_NAMES, WorkloadOptions, make_workload
from pdserve.bench.workloads.trace import TraceWorkload
from pdserve.bench.workloads.trace_file import (
    TraceEntry,
    TraceWindow,
    default_trace_path,
    load_trace,
    write_trace_jsonl,
)

__all__ = [
    "WORKLOAD_NAMES",
    "BenchRequest",
    "LengthRange",
    "LongContextWorkload",
    "MixedWorkload",
    "PrefixRepetitionWorkload",
    "RandomWorkload",
    "TraceEntry",
    "TraceWindow",
    "TraceWorkload",
    "Workload",
    "WorkloadOptions",
    "default_trace_path",
    "load_trace",
    "make_workload",
    "write_trace_jsonl",
]
