"""pdserve.workload: what a benchmark run sends and what it measured, shared by the load
generator (`pdserve.bench`, over HTTP) and the simulator (`pdserve.sim`, on a simulated clock).

- Workloads (`Workload` and its kinds, `make_workload`, `WORKLOAD_FLAGS`): requests of exact
  token lengths, reproducible from a seed (`arrivals`, `prompts`, `tokenizer`, `trace_file`:
  the default trace, gzipped, with its provenance in `data/`).
- A run as data (`run`: `BenchSpec`, `WorkloadPlan`, `BenchResult`, `summarize`; `endpoint`:
  where its requests go), per-request `records`, `metrics`, the `interference` detector.
- Results read and written (`results`), summarized (`summary`), reported (`report`,
  `plots`) and tabled (`table`).

Nothing here opens a connection; the package's own names below are the workloads'.
"""

from pdserve.workload.base import BenchRequest, LengthRange, Workload
from pdserve.workload.long_context import LongContextWorkload
from pdserve.workload.mixed import MixedWorkload
from pdserve.workload.prefix_repetition import PrefixRepetitionWorkload
from pdserve.workload.random_lengths import RandomWorkload
from pdserve.workload.registry import WORKLOAD_NAMES, WorkloadOptions, make_workload
from pdserve.workload.trace import TraceWorkload
from pdserve.workload.trace_file import (
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
