"""llama.cpp's prefill and single-stream decode on a GGUF, for benchmarks/engine.py.

Run by the Python of a venv with llama-cpp-python (benchmarks/llama_cpp_venv.sh); prints one
JSON line: {"prefill_tokens_per_s": {length: tok/s}, "decode_step_ms": ms, "version": ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 3000])
    args = parser.parse_args()
    llm = llama_cpp.Llama(
        args.gguf,
        n_ctx=max(args.prefill) + 64,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    rng = random.Random(0)
    prefill = {}
    for length in args.prefill:
        tokens = [rng.randrange(1000, 20000) for _ in range(length)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        prefill[str(length)] = length / (time.perf_counter() - start)
    llm.reset()
    llm.eval([rng.randrange(1000, 20000) for _ in range(args.context)])
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        llm.eval([rng.randrange(1000, 20000)])
        times.append(time.perf_counter() - start)
    result = {
        "prefill_tokens_per_s": prefill,
        "decode_step_ms": statistics.median(times) * 1e3,
        "version": llama_cpp.__version__,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
