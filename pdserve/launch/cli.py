"""`pdserve serve`: one OpenAI-compatible server, or a disaggregated deployment of them.

`--mode colocated|chunked` (and every worker, `--role prefill|decode`) runs the server on one
engine (`server.cli.run_server`); with `--data-parallel-size N` (N > 1, or any N on a cluster)
N such servers, each an engine on its own cores, behind the router (its decode pool: workers
that serve whole requests). `--mode disagg` starts prefill and decode workers and a router in
front. Both on this host's cores (`launch.local`), or with `--cluster ray` as Ray actors
across a cluster's nodes (`launch.ray_cluster`); disagg with `--autoscale` sized by the
router's planner. Each flag is declared once, in its package; `WORKER_FLAGS` (`launch.deployment`)
says which of them a deployment hands on to its workers.
"""

from __future__ import annotations

import argparse

from pdserve.core.config import Mode
from pdserve.engine.args import ENGINE_FLAGS, KV_STORE_FLAGS, KV_TRANSFER_FLAGS
from pdserve.flags import add_flags, config_from_args, flag
from pdserve.kv_store.config import split_password
from pdserve.launch.config import DeploymentConfig
from pdserve.launch.deployment import WORKER_FLAGS
from pdserve.router.cli import (
    AUTOSCALE_FLAGS,
    ROUTING_FLAGS,
    autoscale_config_from_args,
    router_config_from_args,
)
from pdserve.server.cli import SERVER_FLAGS, run_server

_D = DeploymentConfig
DISAGG_FLAGS = (
    flag(
        "--prefill-workers",
        dest="num_prefill_workers",
        type=int,
        default=_D.num_prefill_workers,
        metavar="N",
    ),
    flag(
        "--decode-workers",
        dest="num_decode_workers",
        type=int,
        default=_D.num_decode_workers,
        metavar="N",
    ),
    flag(
        "--worker-base-port",
        type=int,
        default=_D.worker_base_port,
        help="workers listen on consecutive ports from here (default: free ports)",
    ),
    flag(
        "--worker-log-dir",
        default=_D.worker_log_dir,
        help="one log file per worker (default: a new temporary directory)",
    ),
    flag(
        "--startup-timeout",
        dest="startup_timeout_s",
        type=float,
        default=_D.startup_timeout_s,
        metavar="SECONDS",
    ),
    flag(
        "--worker-args",
        default=_D.worker_args,
        help="extra flags for every worker, one shell-quoted string",
    ),
    # One pool's flags come after --worker-args, so they win.
    flag(
        "--prefill-worker-args",
        default=_D.prefill_worker_args,
        metavar="FLAGS",
        help="extra flags for prefill workers only, e.g. '--max-num-batched-tokens 2048'",
    ),
    flag(
        "--decode-worker-args",
        default=_D.decode_worker_args,
        metavar="FLAGS",
        help="extra flags for decode workers only, e.g. '--max-num-batched-tokens 128' "
        "to chunk their local prefills finely",
    ),
)
REPLICA_FLAGS = (
    flag(
        "--data-parallel-size",
        type=int,
        default=_D.data_parallel_size,
        metavar="N",
        help="colocated/chunked: N engine processes, each on its own cores, behind the router "
        "(its routing policies, health checks, /workers, /metrics); 1: one server, no router",
    ),
)
CLUSTER_FLAGS = (
    flag(
        "--cluster",
        default=_D.cluster,
        metavar="ray|ray:local|ray:ADDRESS",
        help="place the workers on a Ray cluster: 'ray' joins $RAY_ADDRESS (else the one "
        "started on this machine), 'ray:ADDRESS' that one (e.g. ray:ray://head:10001), "
        "'ray:local' starts one here; default: this host's cores, no Ray",
    ),
    flag(
        "--prefill-worker-resources",
        default=_D.prefill_worker_resources,
        metavar="JSON",
        help="Ray resources each prefill worker asks for, e.g. '{\"CPU\": 2}' "
        "(default: 1 CPU); its torch threads are its CPUs",
    ),
    flag(
        "--decode-worker-resources",
        default=_D.decode_worker_resources,
        metavar="JSON",
        help='Ray resources each decode worker asks for, e.g. \'{"CPU": 1, "GPU": 1}\'',
    ),
    flag(
        "--placement-strategy",
        choices=("pack", "spread", "strict_pack", "strict_spread"),
        default=_D.placement_strategy,
        help="place the first workers in one Ray placement group with this strategy "
        "(spread: the pools on different nodes where it can); default: wherever Ray "
        "finds the resources",
    ),
    flag(
        "--worker-auth",
        action=argparse.BooleanOptionalAction,
        default=_D.worker_auth,
        help="workers answer only their deployment: a secret ($PDSERVE_FLEET_SECRET, or a new "
        "one) guards their HTTP API (Bearer) and KV port (HMAC); default: on with "
        "--cluster, off on one host",
    ),
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_flags(parser, "server", SERVER_FLAGS)
    add_flags(parser, "engine", ENGINE_FLAGS)
    add_flags(parser, "KV transfer (disaggregated workers)", KV_TRANSFER_FLAGS)
    add_flags(parser, "shared KV store", KV_STORE_FLAGS)
    add_flags(parser, "data parallel (--mode colocated|chunked)", REPLICA_FLAGS)
    add_flags(parser, "disaggregation (--mode disagg)", DISAGG_FLAGS)
    add_flags(parser, "cluster (replicas or --mode disagg)", CLUSTER_FLAGS)
    add_flags(parser, "routing (replicas or --mode disagg)", ROUTING_FLAGS)
    add_flags(parser, "autoscaling (--mode disagg)", AUTOSCALE_FLAGS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if Mode(args.mode) is not Mode.DISAGG:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.autoscale:
            raise ValueError("--autoscale sizes the pools of --mode disagg")
        if args.data_parallel_size == 1 and args.cluster is None:
            return run_server(args)
    deployment = deployment_config_from_args(args)
    # The deployment's modules only when it is one (Ray only when asked for).
    if deployment.cluster is not None:
        from pdserve.launch.ray_cluster import launch_on_ray

        return launch_on_ray(deployment)
    from pdserve.launch.local import launch_local

    return launch_local(deployment)


def deployment_config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    """The deployment `serve`'s flags describe: the one parse, at the command line's edge."""
    given = {option.dest: getattr(args, option.dest) for option in WORKER_FLAGS}
    if args.kv_store is not None:  # its password goes in the environment (`worker_secrets`)
        given["kv_store"] = split_password(args.kv_store)[0]
    return config_from_args(
        DeploymentConfig,
        args,
        (*DISAGG_FLAGS, *REPLICA_FLAGS, *CLUSTER_FLAGS, *KV_STORE_FLAGS),
        mode=Mode(args.mode),
        router=router_config_from_args(args, (), ()),
        worker_flags=tuple(arg for o in WORKER_FLAGS for arg in o.argv(given[o.dest])),
        autoscale=autoscale_config_from_args(args),
        model=args.model,
        step_log=args.step_log,
        kv_transport=args.kv_transport,
    )
