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

import importlib

# The package's Python API (the run's data types are `pdserve.workload`'s), each name from its
# module, imported when first asked for: importing one module loads that module alone.
_EXPORTS = {
    "ArrivalProcess": "pdserve.workload.arrivals",
    "BenchError": "pdserve.workload.errors",
    "BenchResult": "pdserve.workload.run",
    "BenchSpec": "pdserve.workload.run",
    "CompareResult": "pdserve.bench.compare",
    "CompareSpec": "pdserve.bench.compare",
    "EndpointConfig": "pdserve.workload.endpoint",
    "HFTokenizer": "pdserve.workload.tokenizer",
    "InterferenceConfig": "pdserve.workload.interference",
    "LaunchConfig": "pdserve.bench.launcher",
    "compute_metrics": "pdserve.workload.metrics",
    "detect_interference": "pdserve.workload.interference",
    "format_summary": "pdserve.workload.summary",
    "launch_server": "pdserve.bench.launcher",
    "load_tokenizer": "pdserve.workload.tokenizer",
    "plan_workload": "pdserve.workload.run",
    "run_benchmark": "pdserve.bench.benchmark",
    "run_compare": "pdserve.bench.compare",
    "save_compare": "pdserve.bench.compare",
    "save_results": "pdserve.workload.results",
    "write_report": "pdserve.workload.report",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
