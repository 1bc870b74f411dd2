"""The engine's command-line flags (`pdserve generate`, `serve` and its workers) and the one
way from parsed flags to an `EngineConfig`. Every default is its config field's."""

from __future__ import annotations

import argparse

from pdserve.core.config import DEFAULT_CHUNKED_BUDGET, CacheConfig, SchedulerConfig
from pdserve.engine.config import DTYPES, KV_FAILURE_POLICIES, QUANTIZATIONS, EngineConfig
from pdserve.flags import flag
from pdserve.fleet import FleetTLS
from pdserve.kv_store.config import KVStoreConfig, read_namespace_secret, read_password
from pdserve.kv_transfer.config import KVRole, KVTransferConfig
from pdserve.kv_transfer.registry import TRANSPORTS
from pdserve.model.config import KV_CACHE_DTYPES

# A worker's --role to its part in KV transfer (both: a plain server, no transfer).
ROLE_TO_KV_ROLE = {"prefill": KVRole.PRODUCER, "decode": KVRole.CONSUMER, "both": None}

_KV = KVTransferConfig
ENGINE_FLAGS = (
    flag(
        "--model",
        default=EngineConfig.model,
        help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file or a Hugging "
        "Face folder (config.json + safetensors + tokenizer.json)",
    ),
    flag("--dtype", default=EngineConfig.dtype, choices=DTYPES),
    flag(
        "--quantization",
        default=EngineConfig.quantization,
        choices=QUANTIZATIONS,
        help="linear weights: none (the dtype), int8 (weight-only, computed at load) or gguf "
        "(a GGUF file's own Q8_0/Q4_0/Q4_1 blocks, multiplied without dequantizing)",
    ),
    flag(
        "--kv-cache-dtype",
        default=EngineConfig.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV cache's dtype (auto: the model's)",
    ),
    flag("--device", default=EngineConfig.device, help="cpu, cuda or auto"),
    flag(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help=f"per-step token budget (default {DEFAULT_CHUNKED_BUDGET} when "
        "chunked; the context length when colocated)",
    ),
    flag("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs),
    flag(
        "--long-prefill-token-threshold",
        type=int,
        default=SchedulerConfig.long_prefill_token_threshold,
        help="most tokens of one prompt in a chunked step while other requests run or wait: "
        "a long prompt stalls running streams for at most this many (default %(default)s; "
        "the budget for no cap)",
    ),
    flag("--max-num-partial-prefills", type=int, default=SchedulerConfig.max_num_partial_prefills),
    flag("--block-size", type=int, default=CacheConfig.block_size),
    flag("--num-kv-blocks", type=int, default=CacheConfig.num_blocks),
    flag(
        "--kv-cache-memory-gb",
        type=float,
        default=CacheConfig.kv_cache_memory_gb,
        help="KV cache size unless --num-kv-blocks (default: %(default)s)",
    ),
    flag(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=CacheConfig.enable_prefix_caching,
    ),
    flag(
        "--max-model-len",
        type=int,
        default=SchedulerConfig.max_model_len,
        help="longest prompt + output (default: the model's context, as the KV cache holds)",
    ),
    flag("--seed", type=int, default=EngineConfig.seed),
    flag(
        "--num-threads",
        type=int,
        default=EngineConfig.num_threads,
        help="compute threads for the forward pass (default 1: one worker per core, as the "
        "launchers start them; on a machine this server has alone, give it its cores)",
    ),
    flag(
        "--step-log",
        default=EngineConfig.step_log,
        metavar="FILE.jsonl",
        help="append one JSON line per engine step (batch composition, wall "
        "time): calibration data for `pdserve simulate calibrate --steps`",
    ),
)
KV_TRANSFER_FLAGS = (
    flag(
        "--role",
        choices=tuple(ROLE_TO_KV_ROLE),
        default="both",
        help="prefill: run prompts and lease their KV blocks to decode workers; "
        "decode: receive KV blocks and decode; both: a plain server",
    ),
    flag(
        "--kv-transport",
        choices=TRANSPORTS,
        default=_KV.transport,
        help="how KV blocks move between workers: shared memory (same host), TCP, or auto: "
        "shared memory with workers on this --kv-node-id, TCP with the others",
    ),
    flag(
        "--kv-node-id",
        default=_KV.kv_node_id,
        help="the node this worker runs on, for --kv-transport auto (default: this host)",
    ),
    flag("--kv-host", default=_KV.kv_host, help="where a prefill worker's KV server binds"),
    flag("--kv-port", type=int, default=_KV.kv_port, help="0: any free port"),
    flag(
        "--kv-advertise-host",
        default=_KV.kv_advertise_host,
        help="the address decode workers reach the KV server at",
    ),
    flag(
        "--kv-lease-timeout",
        type=float,
        default=_KV.kv_lease_timeout,
        help="seconds a prefill worker holds KV blocks nobody fetched",
    ),
    flag(
        "--kv-transfer-timeout",
        type=float,
        default=_KV.kv_transfer_timeout,
        help="seconds a decode worker waits on a KV transfer operation",
    ),
    flag(
        "--kv-failure-policy",
        choices=KV_FAILURE_POLICIES,
        default=EngineConfig.kv_failure_policy,
        help="when KV never arrives: recompute the prompt here, or fail",
    ),
)
KV_STORE_FLAGS = (
    flag(
        "--kv-store",
        default=EngineConfig.kv_store,
        metavar="URL",
        help="share computed KV blocks with every worker using the same store: 'local' "
        "(shared memory on this host), 'local:DIR', or redis://[user:password@]host:port/db "
        "(rediss:// for TLS); off when not given",
    ),
    flag(
        "--kv-store-max-gb",
        type=float,
        default=KVStoreConfig.max_gb,
        help="capacity of the local store (a Redis server's is its own maxmemory)",
    ),
    flag(
        "--kv-store-namespace",
        default=KVStoreConfig.namespace,
        help="salts every key: workers in different namespaces never share blocks",
    ),
    flag(
        "--kv-store-password-file",
        metavar="FILE",
        help="the Redis password (its first line), kept out of argv; or set "
        "$PDSERVE_KV_STORE_PASSWORD",
    ),
    flag(
        "--kv-store-namespace-secret-file",
        metavar="FILE",
        help="a secret (its first line) that keys the namespace's salt: without it no one "
        "can compute this namespace's keys; or set $PDSERVE_KV_STORE_NAMESPACE_SECRET",
    ),
)
# KV transfer flags that are KVTransferConfig's fields of the same name.
_KV_FIELDS = (
    "kv_host",
    "kv_port",
    "kv_advertise_host",
    "kv_lease_timeout",
    "kv_transfer_timeout",
    "kv_node_id",
)


def engine_config_from_args(
    args: argparse.Namespace, fleet_secret: str | None = None, fleet_tls: FleetTLS | None = None
) -> EngineConfig:
    """The engine `args` (`ENGINE_FLAGS`, `--mode`, and `KV_TRANSFER_FLAGS` and
    `KV_STORE_FLAGS` where the command has them) describe; `fleet_secret` and `fleet_tls`
    (never flags: `pdserve.fleet`) guard its KV server and connections."""
    kwargs = {option.dest: getattr(args, option.dest) for option in ENGINE_FLAGS}
    if hasattr(args, "role"):
        kwargs.update(
            kv_transfer=kv_transfer_config(args, fleet_secret, fleet_tls),
            kv_failure_policy=args.kv_failure_policy,
        )
    if hasattr(args, "kv_store"):
        kwargs["kv_store"] = kv_store_config(args)
    return EngineConfig.from_kwargs(mode=args.mode, **kwargs)


def kv_transfer_config(
    args: argparse.Namespace, fleet_secret: str | None = None, fleet_tls: FleetTLS | None = None
) -> KVTransferConfig | None:
    kv_role = ROLE_TO_KV_ROLE[args.role]
    if kv_role is None:
        return None
    fields = {name: getattr(args, name) for name in _KV_FIELDS}
    return KVTransferConfig(
        transport=args.kv_transport,
        kv_role=kv_role,
        secret=fleet_secret,
        tls=fleet_tls,
        **fields,
    )


def kv_store_config(args: argparse.Namespace) -> KVStoreConfig | None:
    if args.kv_store is None:
        return None
    return KVStoreConfig(
        args.kv_store,
        max_gb=args.kv_store_max_gb,
        namespace=args.kv_store_namespace,
        password=read_password(args.kv_store_password_file),
        namespace_secret=read_namespace_secret(args.kv_store_namespace_secret_file),
    )
