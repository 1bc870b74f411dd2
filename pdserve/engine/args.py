"""Command-line flags for the engine, shared by `pdserve generate`, `serve` and workers."""

from __future__ import annotations

import argparse

from pdserve.core.config import SchedulerConfig, SchedulingPolicy
from pdserve.engine.config import DTYPES, KV_FAILURE_POLICIES, EngineConfig
from pdserve.kv_transfer.config import KVRole, KVTransferConfig
from pdserve.kv_transfer.protocol import TRANSPORT_NAMES
from pdserve.model.config import KV_CACHE_DTYPES, Quantization

# A worker's --role to its part in KV transfer (both: a plain server, no transfer).
ROLE_TO_KV_ROLE = {"prefill": KVRole.PRODUCER, "decode": KVRole.CONSUMER, "both": None}

DEFAULT_CHUNKED_BUDGET = 512


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file or a Hugging "
        "Face folder (config.json + safetensors + tokenizer.json)",
    )
    group.add_argument("--dtype", default="auto", choices=DTYPES)
    group.add_argument(
        "--quantization",
        default=EngineConfig.quantization,
        choices=[q.value for q in Quantization],
        help="linear weights: none (the dtype), int8 (weight-only, computed at load) or gguf "
        "(a GGUF file's own Q8_0/Q4_0/Q4_1 blocks, multiplied without dequantizing)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default=EngineConfig.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV cache's dtype (auto: the model's)",
    )
    group.add_argument("--device", default="auto", help="cpu, cuda or auto")
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"per-step token budget (default {DEFAULT_CHUNKED_BUDGET} when "
        "chunked; the context length when colocated)",
    )
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--long-prefill-token-threshold", type=int, default=None)
    group.add_argument("--max-num-partial-prefills", type=int, default=1)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-memory-gb", type=float, default=None)
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="compute threads for the forward pass (default 1: decode runs in single-threaded "
        "kernels, and a second OpenMP thread stalls prefill whenever another thread holds its "
        "core; use more cores with more workers, or set this on an otherwise idle machine)",
    )
    group.add_argument(
        "--step-log",
        default=None,
        metavar="FILE.jsonl",
        help="append one JSON line per engine step (batch composition, wall "
        "time): calibration data for `pdserve simulate calibrate --steps`",
    )
    add_kv_transfer_args(parser)


def add_kv_transfer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("disaggregated worker")
    group.add_argument(
        "--role",
        choices=tuple(ROLE_TO_KV_ROLE),
        default="both",
        help="prefill: run prompts and lease their KV blocks to decode workers; "
        "decode: receive KV blocks and decode; both: a plain server",
    )
    group.add_argument("--kv-transport", choices=TRANSPORT_NAMES, default="shm")
    group.add_argument(
        "--kv-host", default="127.0.0.1", help="where a prefill worker's KV server binds"
    )
    group.add_argument("--kv-port", type=int, default=0, help="0: any free port")
    group.add_argument(
        "--kv-advertise-host",
        default=None,
        help="the address decode workers reach the KV server at",
    )
    group.add_argument(
        "--kv-lease-timeout",
        type=float,
        default=30.0,
        help="seconds a prefill worker holds KV blocks nobody fetched",
    )
    group.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=10.0,
        help="seconds a decode worker waits on a KV transfer operation",
    )
    group.add_argument(
        "--kv-failure-policy",
        choices=KV_FAILURE_POLICIES,
        default="recompute",
        help="when KV never arrives: recompute the prompt here, or fail",
    )


def engine_config_from_args(args: argparse.Namespace, mode: str) -> EngineConfig:
    """`mode` is the scheduling of this engine: colocated or chunked."""
    return engine_config_from_kwargs(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        mode=mode,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_threads=args.num_threads,
        kv_transfer=kv_transfer_config(args),
        kv_failure_policy=args.kv_failure_policy,
        step_log=args.step_log,
    )


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig | None:
    kv_role = ROLE_TO_KV_ROLE[args.role]
    if kv_role is None:
        return None
    return KVTransferConfig(
        transport=args.kv_transport,
        kv_role=kv_role,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_advertise_host=args.kv_advertise_host,
        kv_lease_timeout=args.kv_lease_timeout,
        kv_transfer_timeout=args.kv_transfer_timeout,
    )


def engine_config_from_kwargs(
    *,
    mode: str = "chunked",
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = 64,
    long_prefill_token_threshold: int | None = None,
    max_num_partial_prefills: int = 1,
    **engine_kwargs,
) -> EngineConfig:
    """Flat keyword arguments (the CLI's names) to an `EngineConfig`."""
    scheduling = SchedulingPolicy(mode)
    if max_num_batched_tokens is None:
        # Colocated takes prompts whole; its budget only bounds how many share a step.
        max_num_batched_tokens = (
            DEFAULT_CHUNKED_BUDGET
            if scheduling is SchedulingPolicy.CHUNKED
            else engine_kwargs.get("max_model_len") or 8192
        )
    scheduler = SchedulerConfig(
        scheduling=scheduling,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
    )
    return EngineConfig(scheduler=scheduler, **engine_kwargs)
