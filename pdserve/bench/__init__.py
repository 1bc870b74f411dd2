"""pdserve.bench: a load generator and report for OpenAI-compatible servers.

Command line (`pdserve bench ...`, or `python -m pdserve.bench ...`):

    pdserve bench --base-url URL --workload mixed --request-rate 1 --goodput ttft:2000 tpot:100 \\
        --save-result run.json --report out/
    pdserve bench compare --modes colocated,chunked,disagg --external vllm=http://127.0.0.1:8001
    pdserve bench convert-trace --output trace.jsonl --num-prompts 200 --trace-time-scale 4

Python:

    spec = BenchSpec(EndpointConfig("http://127.0.0.1:8000"), MixedWorkload(num_prompts=20))
    [result] = run_benchmark(spec, tokenizer)   # tokenizer: anything with encode/decode
    print(format_summary(result)); save_results([result], "run.json")
    write_report([result], "out/", "my run")

Metrics follow `vllm bench serve` (TTFT, TPOT, ITL, E2EL, goodput); see `metrics`. No torch:
pdserve's tokenizer is imported only when no tokenizer file is given.
"""

from pdserve.bench.arrivals import ArrivalProcess
from pdserve.bench.benchmark import BenchResult, BenchSpec, plan_workload, run_benchmark
from pdserve.bench.client import EndpointConfig
from pdserve.bench.compare import CompareResult, CompareSpec, run_compare, save_compare
from pdserve.bench.errors import BenchError
from pdserve.bench.interference import InterferenceConfig, detect_interference
from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.report import write_report
from pdserve.bench.results import save_results
from pdserve.bench.summary import format_summary
from pdserve.bench.tokenizer import HFTokenizer, load_tokenizer

__all__ = [
    "ArrivalProcess",
    "BenchError",
    "BenchResult",
    "BenchSpec",
    "CompareResult",
    "CompareSpec",
    "EndpointConfig",
    "HFTokenizer",
    "InterferenceConfig",
    "LaunchConfig",
    "compute_metrics",
    "detect_interference",
    "format_summary",
    "launch_server",
    "load_tokenizer",
    "plan_workload",
    "run_benchmark",
    "run_compare",
    "save_compare",
    "save_results",
    "write_report",
]
