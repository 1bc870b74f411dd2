"""Engine speed against the memory floor, Hugging Face transformers and llama.cpp, same run.

For each run (a dtype, or a weight format: gguf = the GGUF's own blocks, int8): prefill
tokens/s for 512- and 3,000-token prompts, the 3,000-token prompt in 256-token chunks (the
chunked server's steps) against one-shot, and decode step time at batch 1, 8 and 32 (each
sequence holding a 512-token prompt; the median of 32 steps). Next to each figure: transformers
on the same weights in the same dtype (float32 for the quantized runs), llama.cpp on the same
GGUF with one thread (when `--llama-cpp-python` names a Python with llama-cpp-python, see
llama_cpp_venv.sh), and the floor: the bytes a decode step reads (weights in their stored
format + the KV cache) over the read bandwidth measured here (the run's threads streaming a
1 GiB buffer; the best of a measurement before every run and one after the last, as is the
roof; "x ws" beside it: against the floor of the step's own working set, streamed as a
buffer of its size right after the step, which a large cache can hold), and the roof: the
activations' dtype's best GEMM on these threads (2048^3: the better of `torch.mm`,
oneDNN/MKL, and oneDNN's linear on a packed weight as the engine's prefill runs it; AMX tiles
for bfloat16 where the CPU has them; for bfloat16 activations and for
quantized weights the better of float32's and bfloat16's), against which prefill's rate (the
linears' and the causal attention's FLOPs per second) is reported. Each decode step also gets
its compute time (its FLOPs over the roof of the products its kernels take, see
`Limits.apply`) and its roofline bound: a step runs its linears (reading the weights) and its
attention (reading the KV cache) one after the other, so the bound is the sum of each phase's
larger of bytes over bandwidth and FLOPs over roof.
Quantized and bf16 runs also report teacher-forced quality against float32
(`pdserve.model.quality`). The CPU's ISA flags and the kernel variant that ran are printed and
saved, with what `--dtype auto` picks here; `--isa` runs another variant this CPU runs (as
PDSERVE_CPU_ISA does).

    .venv/bin/python benchmarks/engine.py [--runs float32 bfloat16 gguf int8] [--json F]
        [--isa amx|avx512_bf16|avx512|avx2|portable] [--no-transformers] [--no-quality]
        [--llama-cpp-python .venv-llama-cpp/bin/python]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pdserve  # noqa: F401  (before torch: it sets OpenMP's wait policy)

# isort: split
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.attention import kv_bytes_per_token
from pdserve.model.auto_dtype import measured_cpu_dtype
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_runtime import huge_page_buffer, read_cpu_flags
from pdserve.model.kernels.cpu_ops import ISA_ENV, load_cpu_ops
from pdserve.model.loader import load_model
from pdserve.model.quality import reference_token_ids, teacher_force

PREFILL_LENGTHS = (512, 3000)
CHUNKED_LENGTH, CHUNK = 3000, 256
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512
DECODE_STEPS = 32
# The mean context a timed decode step attends to: the prompt, the untimed first step's token,
# and the tokens of the timed steps up to its own. The floor and the compute count it.
DECODE_MEAN_CONTEXT = DECODE_CONTEXT + 1 + (DECODE_STEPS + 1) / 2
# name -> (dtype, quantization); quantized runs keep the activations in `--quant-dtype`.
RUNS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "gguf": (None, "gguf"),
    "int8": (None, "int8"),
}
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "asimd")
LLAMA_CPP_SCRIPT = Path(__file__).with_name("llama_cpp_bench.py")


def measure_bandwidth(num_threads: int, repeats: int = 5, nbytes: int = 2**30) -> float:
    """Bytes/s `num_threads` threads read streaming a buffer of about `nbytes` (by default 1
    GiB, far larger than cache), each its share (best of `repeats`, after a first pass)."""
    ops = load_cpu_ops()
    step = 64 * num_threads  # stream_sum's multiple of floats
    # In 2 MiB pages, as the kernels' weights and KV are (huge_page_buffer).
    num_values = max(step, -(-nbytes // 4 // step) * step)
    values = huge_page_buffer(4 * num_values).view(torch.float32).fill_(1.0)
    if ops is None:
        reader = values.sum
    else:

        def reader():
            return ops.stream_sum(values, num_threads)

    reader()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reader()
        best = min(best, time.perf_counter() - start)
    return values.numel() * 4 / best


def measure_gemm_roof(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s (int8: multiply-add ops/s) of the best square matmul in `dtype` here (best of
    `repeats`): `torch.mm`, or `torch._int_mm` (int8 in, int32 out) for int8; for float
    dtypes also oneDNN's linear on a packed weight, the path the engine's prefill takes (on
    AMD, float32 `torch.mm` runs MKL's generic kernels at about half oneDNN's speed)."""
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        a, b = (
            torch.randint(-127, 128, (size, size), generator=generator, dtype=dtype)
            for _ in range(2)
        )
        matmuls = [functools.partial(torch._int_mm, a, b)]
    else:
        a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
        matmuls = [functools.partial(torch.mm, a, b)]
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
            matmuls.append(
                functools.partial(
                    torch.ops.mkldnn._linear_pointwise, a, packed, None, "none", [], ""
                )
            )
        except (AttributeError, RuntimeError):  # a torch build without oneDNN: torch.mm alone
            pass
    best = float("inf")
    for matmul in matmuls:
        matmul()
        for _ in range(repeats):
            start = time.perf_counter()
            matmul()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def linear_macs(config: ModelConfig) -> int:
    """Multiply-adds of every decoder layer's linears for one token (the LM head not counted)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    return (per_layer + 3 * hidden * inter) * config.num_hidden_layers


def attention_flop(config: ModelConfig, pairs: float) -> float:
    """FLOPs of QK^T and PV over `pairs` (query, position) pairs in every layer and head."""
    heads = config.num_attention_heads * config.num_hidden_layers
    return 4 * config.head_dim * heads * pairs


def prefill_flop(config: ModelConfig, length: int) -> float:
    """Multiply-add FLOPs of one `length`-token prefill: every layer's linears on every token,
    the LM head on the last, and causal attention (QK^T and PV over the visible pairs)."""
    linear = 2 * length * linear_macs(config) + 2 * config.hidden_size * config.vocab_size
    return linear + attention_flop(config, length * (length + 1) / 2)


def decode_phases(
    config: ModelConfig, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float
) -> dict:
    """The bytes and FLOPs of one decode step's two phases, which run one after the other:
    `batch` tokens through the linears and the LM head (reading every weight), then each
    attending to `context` positions (reading their KV)."""
    macs = linear_macs(config) + config.hidden_size * config.vocab_size
    return {
        "linears": {"bytes": weight_bytes, "flop": 2 * batch * macs},
        "attention": {
            "bytes": batch * context * kv_bytes_per_token,
            "flop": batch * attention_flop(config, context),
        },
    }


def prompt_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 20000, (length,), generator=generator).tolist()


def make_engine(
    loaded, threads: int, mode: str = "colocated", budget: int | None = None
) -> LLMEngine:
    config = EngineConfig.from_kwargs(
        mode=mode,
        num_threads=threads,
        max_num_batched_tokens=budget,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device="cpu",
        enable_prefix_caching=False,
        max_num_seqs=64,
        kv_cache_memory_gb=2.0,
    )
    return LLMEngine(config, loaded=loaded)


def pdserve_prefill(engine: LLMEngine, length: int) -> float:
    """Seconds to prefill one prompt (every step until its first token)."""
    engine.add_request(
        f"p{length}-{time.time()}", prompt_ids(length, length), SamplingParams(max_tokens=1)
    )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def pdserve_decode(engine: LLMEngine, batch: int) -> float:
    """Median seconds per decode step with `batch` sequences of DECODE_CONTEXT tokens."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", prompt_ids(DECODE_CONTEXT, 10_000 + i), params)
    while any(r.is_prefilling for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()
    times = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def hf_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@torch.inference_mode()
def hf_prefill(model, length: int) -> float:
    ids = torch.tensor([prompt_ids(length, length)])
    start = time.perf_counter()
    model(ids, logits_to_keep=1)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_decode(model, batch: int) -> float:
    ids = torch.tensor([prompt_ids(DECODE_CONTEXT, 10_000 + i) for i in range(batch)])
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def llama_cpp(python: str, gguf: Path, threads: int) -> dict | None:
    """llama.cpp's figures on the same GGUF, from llama_cpp_bench.py run by `python`."""
    command = [python, str(LLAMA_CPP_SCRIPT), str(gguf), "--threads", str(threads)]
    command += ["--context", str(DECODE_CONTEXT), "--steps", str(DECODE_STEPS)]
    command += ["--prefill", *map(str, PREFILL_LENGTHS)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"llama.cpp: not measured ({e})", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


class Limits:
    """The machine's read bandwidth and GEMM roofs: the best of measurements taken before
    every run and after the last, so that a moment of load from other processes (the floor's
    and roof's figures would be too low) is outlived by a quieter one."""

    def __init__(self) -> None:
        self.bandwidth = 0.0
        self.roofs = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.int8: 0.0}

    def measure(self) -> None:
        self.bandwidth = max(self.bandwidth, measure_bandwidth(torch.get_num_threads()))
        for dtype in self.roofs:
            self.roofs[dtype] = max(self.roofs[dtype], measure_gemm_roof(dtype))

    def apply(self, row: dict) -> None:
        """Fill in `row`'s fractions of the roof and its decode steps' bounds.

        Prefill is judged against the activations' dtype's roof, bfloat16's and quantized
        weights' against the better float roof (without bf16 dot products the kernels widen
        bfloat16 to float32; gguf's prefill takes bf16 dot products where the CPU has them).
        A decode step's floor is its bytes over the bandwidth. Its bound is the sum over its
        phases (decode_phases), which run one after the other, of the larger of each one's
        bytes over the bandwidth and its FLOPs over the roof of the products its kernels take:
        - the linears': int8 for gguf, which quantizes x per block; float32 for float32
          activations; for bfloat16 ones (int8 weight-only included, which keeps x exact) the
          better float roof (bf16 dot products, or widening to float32 FMAs where those win);
        - the attention's: half its FLOPs (QK) at the linears' float roof where q and K are
          both bfloat16, else float32's; the other half (PV, float32 FMAs) at float32's.
        No step can beat it, so a goal set in multiples of the floor below the bound cannot
        be met here.
        The floor reads at memory's pace; a step whose bytes (weights + KV) fit in a shared
        last-level cache can beat it where that cache keeps them (a KVM guest's L3 of
        hundreds of MB, while its other tenants are quiet). Each decode step therefore also
        gets its working set's floor: its bytes over the rate of streaming a buffer of as
        many bytes, over and over, measured right after the step."""
        f32 = self.roofs[torch.float32]
        floats = max(f32, self.roofs[torch.bfloat16])
        is_bf16 = row["dtype"] == "bfloat16"
        activations = floats if is_bf16 else f32
        roof = activations if row["quantization"] == "none" else floats
        linear_roof = self.roofs[torch.int8] if row["quantization"] == "gguf" else activations
        qk_roof = activations if is_bf16 and row["kv_cache_dtype"] == "bfloat16" else f32
        row["roof_gflop_s"] = roof / 1e9
        row["decode_roof_gflop_s"] = linear_roof / 1e9
        for p in row["prefill"].values():
            p["of_roof"] = p["gflop_s"] * 1e9 / roof
        for d in row["decode"].values():
            linears, attention = d["phases"]["linears"], d["phases"]["attention"]
            linears["compute_ms"] = linears["flop"] / linear_roof * 1e3
            attention["compute_ms"] = (
                attention["flop"] / 2 / qk_roof + attention["flop"] / 2 / f32
            ) * 1e3
            for phase in d["phases"].values():
                phase["floor_ms"] = phase["bytes"] / self.bandwidth * 1e3
            d["floor_ms"] = sum(p["floor_ms"] for p in d["phases"].values())
            d["compute_ms"] = sum(p["compute_ms"] for p in d["phases"].values())
            d["bound_ms"] = sum(max(p["floor_ms"], p["compute_ms"]) for p in d["phases"].values())
            d["x_floor"] = d["pdserve_step_ms"] / d["floor_ms"]
            if d.get("working_set_bandwidth"):
                bytes_read = sum(p["bytes"] for p in d["phases"].values())
                d["working_set_floor_ms"] = bytes_read / d["working_set_bandwidth"] * 1e3
                d["x_working_set_floor"] = d["pdserve_step_ms"] / d["working_set_floor_ms"]
            d["x_bound"] = d["pdserve_step_ms"] / d["bound_ms"]


def bench_run(name: str, args, hf_folder: Path | None, reference) -> dict:
    dtype, quantization = RUNS[name]
    loaded = load_model(
        None, dtype=dtype or args.quant_dtype, device="cpu", quantization=quantization
    )
    engine = make_engine(loaded, args.threads)
    hf = None
    if hf_folder is not None:
        hf = hf_model(hf_folder, loaded.dtype if quantization == "none" else torch.float32)
    weights = loaded.model.weight_nbytes
    kv_per_token = kv_bytes_per_token(loaded.config, engine.kv_cache_dtype)
    row = {
        "run": name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quantization": quantization,
        "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
        "kernel_variant": loaded.kernel_isa,
        "weight_bytes": weights,
        "prefill": {},
        "decode": {},
    }
    pdserve_prefill(engine, 64)  # warm up
    # Each length once first: a kernel choice it meets unmeasured (its startup budget left it
    # out, as after any kernel edit) is measured the way a server does it, while idle.
    for length in PREFILL_LENGTHS:
        pdserve_prefill(engine, length)
    while engine.measure_when_idle():
        pass
    for length in PREFILL_LENGTHS:
        ours = pdserve_prefill(engine, length)
        theirs = hf_prefill(hf, length) if hf else None
        row["prefill"][length] = {
            "pdserve_tokens_per_s": length / ours,
            "gflop_s": prefill_flop(loaded.config, length) / ours / 1e9,
            "transformers_tokens_per_s": length / theirs if theirs else None,
        }
    chunked = pdserve_prefill(make_engine(loaded, args.threads, "chunked", CHUNK), CHUNKED_LENGTH)
    one_shot = CHUNKED_LENGTH / row["prefill"][CHUNKED_LENGTH]["pdserve_tokens_per_s"]
    row["chunked_prefill"] = {
        "tokens": CHUNKED_LENGTH,
        "chunk": CHUNK,
        "seconds": chunked,
        "one_shot_seconds": one_shot,
        "ratio": chunked / one_shot,
    }
    for batch in DECODE_BATCHES:
        step = pdserve_decode(engine, batch)
        phases = decode_phases(loaded.config, weights, kv_per_token, batch, DECODE_MEAN_CONTEXT)
        working_set = sum(p["bytes"] for p in phases.values())
        row["decode"][batch] = {
            "pdserve_step_ms": step * 1e3,
            "transformers_step_ms": hf_decode(hf, batch) * 1e3 if hf else None,
            "phases": phases,
            # Measured right after the step, in the same state of the machine (its caches'
            # other tenants included): see Limits.apply.
            "working_set_bandwidth": measure_bandwidth(args.threads, nbytes=int(working_set)),
        }
    if reference is not None and name != "float32":
        ids, float32 = reference
        scored = teacher_force(loaded, ids)
        row["quality"] = {
            "tokens": len(ids),
            "top1_agreement": scored.top1_agreement(float32),
            "perplexity": scored.perplexity,
            "float32_perplexity": float32.perplexity,
        }
    if quantization == "gguf" and args.llama_cpp_python:
        row["llama_cpp"] = llama_cpp(args.llama_cpp_python, loaded.path, args.threads)
    return row


def _cell(value: float | None, width: int, digits: int) -> str:
    """`value` right-aligned, or "-" where it was not measured."""
    return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"


def print_table(result: dict) -> None:
    print(
        f"\nCPU flags: {' '.join(result['cpu_isa_flags']) or '-'}; read bandwidth "
        f"{result['bandwidth_gb_s']:.1f} GB/s on {result['threads']} thread(s); "
        "GEMM roof "
        + ", ".join(f"{dtype} {gflop:.0f} GFLOP/s" for dtype, gflop in result["roofs"].items())
        + f"; --dtype auto picks {result['auto_dtype']} here"
    )
    for r in result["runs"]:
        lc = r.get("llama_cpp") or {}
        print(
            f"\n{r['run']}: {r['dtype']} activations, weights {r['quantization']} "
            f"({r['weight_bytes'] / 1e6:.0f} MB), KV {r['kv_cache_dtype']}, "
            f"kernels {r['kernel_variant']}, roof {r['roof_gflop_s']:.0f} GFLOP/s "
            f"(decode {r['decode_roof_gflop_s']:.0f})"
        )
        print(
            f"{'prefill':>14} {'pdserve tok/s':>14} {'GFLOP/s':>8} {'of roof':>8} "
            f"{'transformers':>13} {'x hf':>6} {'llama.cpp':>10}"
        )
        for length, p in r["prefill"].items():
            hf = p["transformers_tokens_per_s"]
            peer = lc.get("prefill_tokens_per_s", {}).get(str(length))
            ratio = p["pdserve_tokens_per_s"] / hf if hf else None
            print(
                f"{length:>14} {p['pdserve_tokens_per_s']:>14.0f} {p['gflop_s']:>8.1f} "
                f"{p['of_roof']:>8.0%} {_cell(hf, 13, 0)} "
                f"{_cell(ratio, 5, 2)}x {_cell(peer, 10, 0)}"
            )
        c = r["chunked_prefill"]
        print(
            f"{'chunked':>14} {c['tokens']} tokens in {c['chunk']}-token chunks: "
            f"{c['seconds']:.2f} s vs one-shot {c['one_shot_seconds']:.2f} s ({c['ratio']:.2f}x)"
        )
        print(
            f"{'decode batch':>14} {'pdserve ms':>14} {'transformers':>13} {'floor ms':>9} "
            f"{'x floor':>8} {'x ws':>6} {'compute ms':>11} {'x bound':>8} {'llama.cpp':>10}"
        )
        for batch, d in r["decode"].items():
            peer = lc.get("decode_step_ms") if int(batch) == 1 else None
            print(
                f"{batch:>14} {d['pdserve_step_ms']:>14.1f} "
                f"{_cell(d['transformers_step_ms'], 13, 1)} {d['floor_ms']:>9.1f} "
                f"{d['x_floor']:>7.2f}x {_cell(d.get('x_working_set_floor'), 5, 2)}x "
                f"{d['compute_ms']:>11.1f} {d['x_bound']:>7.2f}x "
                f"{_cell(peer, 10, 1)}"
            )
        if "quality" in r:
            q = r["quality"]
            change = q["perplexity"] / q["float32_perplexity"] - 1
            print(
                f"{'quality':>14} {q['tokens']} teacher-forced tokens: top-1 agreement with "
                f"float32 {q['top1_agreement']:.1%}, perplexity {q['perplexity']:.3f} vs "
                f"{q['float32_perplexity']:.3f} ({change:+.2%})"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument(
        "--quant-dtype",
        default="auto",
        help="activations of gguf/int8 runs (auto: as `pdserve serve --quantization` runs them)",
    )
    # One thread by default: a disaggregated worker runs on one core. The floor and the roof
    # are measured on the threads the run uses.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--llama-cpp-python", default=None, metavar="PYTHON")
    parser.add_argument("--isa", default=None, help="kernel variant (default: the best here)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.isa:
        os.environ[ISA_ENV] = args.isa
    torch.set_num_threads(args.threads)
    limits = Limits()
    reference = None
    if not args.no_quality:
        float32 = load_model(None, dtype="float32", device="cpu")
        ids = reference_token_ids(float32)
        reference = (ids, teacher_force(float32, ids))
        del float32
    with tempfile.TemporaryDirectory() as tmp:
        folder = None
        if not args.no_transformers:
            from pdserve.model.export_hf import export_hf

            folder = Path(tmp)
            export_hf(None, folder, "float32")
        runs = []
        for name in args.runs:
            limits.measure()
            runs.append(bench_run(name, args, folder, reference))
    limits.measure()
    for row in runs:
        limits.apply(row)
    result = {
        "cpu_isa_flags": sorted(read_cpu_flags() & set(ISA_FLAGS)),
        "bandwidth_gb_s": limits.bandwidth / 1e9,
        "roofs": {str(d).removeprefix("torch."): roof / 1e9 for d, roof in limits.roofs.items()},
        "threads": args.threads,
        "auto_dtype": str(measured_cpu_dtype()).removeprefix("torch."),
        "runs": runs,
    }
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
