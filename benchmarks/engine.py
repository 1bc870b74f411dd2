"""Engine speed against Hugging Face transformers and the memory-bandwidth floor.

For each dtype: prefill tokens/s for 512- and 3,000-token prompts, and decode step time at
batch 1, 8 and 32 (each sequence holding a 512-token context), measured for pdserve and for
transformers on the same weights in the same run. The floor for a decode step is the bytes it
must read (weights + KV) divided by the read bandwidth this script measures with fp32 GEMV.

    .venv/bin/python benchmarks/engine.py [--dtypes float32 bfloat16] [--threads N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.attention import kv_bytes_per_token
from pdserve.model.loader import load_model

PREFILL_LENGTHS = (512, 3000)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512
DECODE_STEPS = 12


def measure_bandwidth() -> float:
    """Bytes/s streamed by an fp32 matrix-vector product over a matrix far larger than cache."""
    matrix = torch.randn(8192, 16384)
    vector = torch.randn(16384)
    torch.mv(matrix, vector)
    start = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        torch.mv(matrix, vector)
    return matrix.numel() * 4 * repeats / (time.perf_counter() - start)


def weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads: every layer's matrices and norms plus the
    output projection (the embedding matrix when tied; one row lookup is negligible)."""
    hidden, kv_size = config.hidden_size, config.num_key_value_heads * config.head_dim
    q_size = config.num_attention_heads * config.head_dim
    per_layer = (
        hidden * (q_size + 2 * kv_size)
        + q_size * hidden
        + 3 * hidden * config.intermediate_size
        + 2 * hidden
    )
    params = config.num_hidden_layers * per_layer + hidden + config.vocab_size * hidden
    return params * torch.finfo(dtype).bits // 8


def prompt_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 20000, (length,), generator=generator).tolist()


def pdserve_prefill(engine: LLMEngine, length: int) -> float:
    """Tokens/s of one whole-prompt prefill step (colocated, prefix cache off)."""
    engine.add_request(f"p{length}", prompt_ids(length, length), SamplingParams(max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return length / (time.perf_counter() - start)


def pdserve_decode(engine: LLMEngine, batch: int) -> float:
    """Seconds per decode step with `batch` sequences of DECODE_CONTEXT tokens."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", prompt_ids(DECODE_CONTEXT, 10_000 + i), params)
    while any(r.is_prefilling for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = (time.perf_counter() - start) / DECODE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def hf_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()


@torch.inference_mode()
def hf_prefill(model, length: int) -> float:
    ids = torch.tensor([prompt_ids(length, length)])
    start = time.perf_counter()
    model(ids, logits_to_keep=1)
    return length / (time.perf_counter() - start)


@torch.inference_mode()
def hf_decode(model, batch: int) -> float:
    ids = torch.tensor([prompt_ids(DECODE_CONTEXT, 10_000 + i) for i in range(batch)])
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / DECODE_STEPS


def bench_dtype(dtype: str, bandwidth: float, hf_folder: Path | None) -> dict:
    loaded = load_model(None, dtype=dtype, device="cpu")
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            mode="colocated",
            dtype=dtype,
            device="cpu",
            enable_prefix_caching=False,
            max_num_seqs=64,
            kv_cache_memory_gb=2.0,
        ),
        loaded=loaded,
    )
    reference = hf_model(hf_folder, loaded.dtype) if hf_folder else None
    weights = weight_bytes(loaded.config, loaded.dtype)
    kv_per_token = kv_bytes_per_token(loaded.config, loaded.dtype)
    rows = {"dtype": dtype, "weight_bytes": weights, "prefill": {}, "decode": {}}
    for length in PREFILL_LENGTHS:
        pdserve_prefill(engine, 64)  # warm up
        rows["prefill"][length] = {
            "pdserve_tokens_per_s": pdserve_prefill(engine, length),
            "transformers_tokens_per_s": hf_prefill(reference, length) if reference else None,
        }
    for batch in DECODE_BATCHES:
        floor = (weights + batch * DECODE_CONTEXT * kv_per_token) / bandwidth
        rows["decode"][batch] = {
            "pdserve_step_ms": pdserve_decode(engine, batch) * 1e3,
            "transformers_step_ms": hf_decode(reference, batch) * 1e3 if reference else None,
            "floor_ms": floor * 1e3,
        }
    return rows


def print_table(result: dict) -> None:
    print(f"\nread bandwidth {result['bandwidth_gb_s']:.1f} GB/s, {result['threads']} threads")
    for rows in result["runs"]:
        print(f"\n{rows['dtype']}: weights {rows['weight_bytes'] / 1e6:.0f} MB")
        print(f"{'prefill':>12} {'pdserve tok/s':>14} {'transformers':>13} {'speed-up':>9}")
        for length, r in rows["prefill"].items():
            hf = r["transformers_tokens_per_s"]
            print(
                f"{length:>12} {r['pdserve_tokens_per_s']:>14.0f} {hf or 0:>13.0f} "
                f"{r['pdserve_tokens_per_s'] / hf if hf else 0:>8.2f}x"
            )
        print(
            f"{'decode batch':>12} {'pdserve ms':>14} {'transformers':>13} {'floor ms':>9} "
            f"{'x floor':>8}"
        )
        for batch, r in rows["decode"].items():
            ours, hf = r["pdserve_step_ms"], r["transformers_step_ms"] or 0
            print(
                f"{batch:>12} {ours:>14.1f} {hf:>13.1f} {r['floor_ms']:>9.1f} "
                f"{ours / r['floor_ms']:>7.2f}x"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    # One thread by default: a disaggregated worker runs on one core, and the floor is set by
    # one core's bandwidth (two OpenMP threads stall whenever the VM's other vCPU is busy).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = measure_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        folder = None
        if not args.no_transformers:
            from pdserve.model.export_hf import export_hf

            folder = Path(tmp)
            export_hf(load_model(None, dtype="float32", device="cpu").path, folder, "float32")
        runs = [bench_dtype(d, bandwidth, folder) for d in args.dtypes]
    result = {"bandwidth_gb_s": bandwidth / 1e9, "threads": args.threads, "runs": runs}
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
