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

# The package's Python API, each name from its module, imported when first asked for: a
# `pdserve.bench.<module>` import (the simulator's, say) loads that module alone.
_EXPORTS = {
    "ArrivalProcess": "arrivals",
    "BenchError": "errors",
    "BenchResult": "benchmark",
    "BenchSpec": "benchmark",
    "CompareResult": "compare",
    "CompareSpec": "compare",
    "EndpointConfig": "client",
    "HFTokenizer": "tokenizer",
    "InterferenceConfig": "interference",
    "LaunchConfig": "launcher",
    "compute_metrics": "metrics",
    "detect_interference": "interference",
    "format_summary": "summary",
    "launch_server": "launcher",
    "load_tokenizer": "tokenizer",
    "plan_workload": "benchmark",
    "run_benchmark": "benchmark",
    "run_compare": "compare",
    "save_compare": "compare",
    "save_results": "results",
    "write_report": "report",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdserve.bench.{_EXPORTS[name]}"), name)
