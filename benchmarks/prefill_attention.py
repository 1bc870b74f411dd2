"""Prefill attention: the native paged kernel against torch SDPA, per kernel variant and dtype.

The engine makes this choice itself, measured at first use on the machine it runs on
(`prefill_kernel_choice` in pdserve/model/attention.py); this script shows the figures for
every variant this CPU runs and each model dtype: the attention of one layer of the default
model's shape (9 query heads on 3 KV heads of 64) for a one-shot prefill and for chunks over a
cached context, timed both ways in the same run (best of `--repeats`), with the rate in
GFLOP/s of the causal attention's multiply-adds (4 * head_dim per visible query/key pair).

To see what torch does on a CPU class this machine is not, narrow torch's own kernels too,
e.g. an AVX2-only one: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (then compare the
avx2 rows only).

    .venv/bin/python benchmarks/prefill_attention.py [--threads 1] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.model.kernels.build import runnable_variants
from pdserve.model.kernels.cpu_ops import load_cpu_ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (cached context, new tokens): one-shot prompts, then 256-token chunks of a long prompt.
CASES = ((0, 512), (0, 3000), (1024, 256), (2744, 256))


def best_seconds(repeats: int, function, *args) -> float:
    function(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args)
        best = min(best, time.perf_counter() - start)
    return best


def measure(isa: str, dtype: torch.dtype, repeats: int, threads: int) -> list[dict]:
    ops = load_cpu_ops(isa)
    if ops is None:
        return []
    sdpa = TorchAttentionBackend(HEAD_DIM**-0.5)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for num_computed, num_new in CASES:
        seq_len = num_computed + num_new
        num_blocks = -(-seq_len // BLOCK_SIZE)
        cache = torch.randn(
            2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator
        ).to(dtype)
        meta = AttentionMetadata.build(
            [(list(range(num_blocks)), num_computed, num_new)], BLOCK_SIZE, "cpu"
        )
        chunk = meta.prefills[0]
        q = torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
        k, v = (cache[i].view(-1, NUM_KV_HEADS, HEAD_DIM)[num_computed:seq_len] for i in (0, 1))
        torch_s = best_seconds(repeats, sdpa._prefill, q, k, v, cache, chunk)
        kernel_s = best_seconds(
            repeats,
            ops.paged_prefill,
            *(q, cache, chunk.block_table, num_computed, sdpa.scale, threads),
        )
        pairs = NUM_HEADS * (num_new * num_computed + num_new * (num_new + 1) / 2)
        flop = 4 * HEAD_DIM * pairs
        rows.append(
            {
                "variant": isa,
                "dtype": str(dtype).removeprefix("torch."),
                "num_computed": num_computed,
                "num_new": num_new,
                "sdpa_ms": torch_s * 1e3,
                "kernel_ms": kernel_s * 1e3,
                "sdpa_gflop_s": flop / torch_s / 1e9,
                "kernel_gflop_s": flop / kernel_s / 1e9,
                "speedup": torch_s / kernel_s,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(
        f"{'variant':>12} {'dtype':>9} {'context':>8} {'new':>5} {'sdpa ms':>9} "
        f"{'GF/s':>6} {'kernel ms':>10} {'GF/s':>6} {'speedup':>8}"
    )
    for variant in runnable_variants():
        for dtype in (torch.float32, torch.bfloat16):
            for r in measure(variant.name, dtype, args.repeats, args.threads):
                rows.append(r)
                print(
                    f"{r['variant']:>12} {r['dtype']:>9} {r['num_computed']:>8} "
                    f"{r['num_new']:>5} {r['sdpa_ms']:>9.2f} {r['sdpa_gflop_s']:>6.0f} "
                    f"{r['kernel_ms']:>10.2f} {r['kernel_gflop_s']:>6.0f} {r['speedup']:>7.2f}x",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
