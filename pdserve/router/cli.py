"""`pdserve router`: the disaggregated-serving gateway in front of prefill and decode workers.

`ROUTING_FLAGS` are the routing group of both `pdserve router` and `pdserve serve --mode
disagg`; every default is its `RouterConfig` field's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.flags import add_flags, config_from_args, flag
from pdserve.fleet import FleetTLS, fleet_secret_from_env
from pdserve.router.autoscale.config import SLO, AutoscaleConfig
from pdserve.router.config import KVHandoff, RouterConfig
from pdserve.router.policies import POLICIES
from pdserve.router.tokenizer import LocalTokenizer, PromptTokenizer

if TYPE_CHECKING:
    from pdserve.router.provision import Provisioner
    from pdserve.router.runtime import Discover

# Seconds uvicorn lets in-flight streams finish after SIGINT/SIGTERM.
GRACEFUL_SHUTDOWN_S = 30

ROUTING_FLAGS = (
    flag(
        "--policy",
        choices=POLICIES,
        default=RouterConfig.prefill_policy,
        help="policy of both pools unless --prefill-policy/--decode-policy",
    ),
    flag("--prefill-policy", choices=POLICIES, default=None),
    flag("--decode-policy", choices=POLICIES, default=None),
    flag(
        "--local-prefill-threshold",
        type=int,
        default=RouterConfig.local_prefill_threshold,
        metavar="N",
        help="prompts with fewer uncached tokens skip the prefill worker (0: all go through one)",
    ),
    KV_HANDOFF_FLAG := flag(
        "--kv-handoff",
        choices=[h.value for h in KVHandoff],
        default=RouterConfig.kv_handoff.value,
        help="pull: the decode worker fetches the KV after the prefill leg answered; stream: "
        "it receives each prompt chunk's KV while the prefill worker computes the next",
    ),
    flag(
        "--shared-kv-store",
        action="store_true",
        default=RouterConfig.shared_kv_store,
        help="the workers share a KV store: count a prefix their store events say it holds "
        "as cached on every worker (implied by serve --mode disagg --kv-store)",
    ),
    flag(
        "--balance-factor",
        type=float,
        default=RouterConfig.balance_factor,
        help="prefix_aware leaves the best match when its load exceeds this "
        "times the least loaded worker's",
    ),
    flag(
        "--health-check-interval",
        dest="health_interval_s",
        type=float,
        default=RouterConfig.health_interval_s,
        metavar="SECONDS",
        help="seconds between GET /health rounds over the workers",
    ),
    flag(
        "--health-check-timeout",
        dest="health_timeout_s",
        type=float,
        default=RouterConfig.health_timeout_s,
        metavar="SECONDS",
    ),
    flag(
        "--unhealthy-threshold",
        type=int,
        default=RouterConfig.unhealthy_threshold,
        help="failed health checks in a row that take a worker out of rotation",
    ),
    flag(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=RouterConfig.request_timeout_s,
        metavar="SECONDS",
        help="bound on each leg's reads (default: none)",
    ),
)
AUTOSCALE_FLAGS = (
    flag(
        "--autoscale",
        action="store_true",
        default=False,
        help="size each pool on its own signal (TTFT and queues for prefill; ITL, KV usage "
        "and queues for decode), adding, draining and switching workers between the pools",
    ),
    flag("--min-prefill-workers", type=int, default=AutoscaleConfig.min_prefill_workers),
    flag("--max-prefill-workers", type=int, default=AutoscaleConfig.max_prefill_workers),
    flag("--min-decode-workers", type=int, default=AutoscaleConfig.min_decode_workers),
    flag("--max-decode-workers", type=int, default=AutoscaleConfig.max_decode_workers),
    flag(
        "--max-workers",
        type=int,
        default=AutoscaleConfig.max_workers,
        help="both pools together (default: the sum of their maxima; on one host at most "
        "one worker per core)",
    ),
    flag(
        "--slo",
        default=None,
        metavar="ttft:MS,itl:MS",
        help="latency targets: prefill workers are added above the TTFT p90, decode "
        "workers above the ITL p90",
    ),
    flag(
        "--autoscale-interval",
        dest="interval_s",
        type=float,
        default=AutoscaleConfig.interval_s,
        metavar="SECONDS",
        help="how often the planner decides (at most one change each time)",
    ),
    flag(
        "--autoscale-grace",
        dest="grace_s",
        type=float,
        default=AutoscaleConfig.grace_s,
        metavar="SECONDS",
        help="no further change this long after adding a worker or switching one",
    ),
    flag(
        "--autoscale-max-step",
        dest="max_step_workers",
        type=int,
        default=AutoscaleConfig.max_step_workers,
        metavar="N",
        help="the most workers one addition starts: a pool k times past its target asks for "
        "ceil(k x its size) - its size (default: one at a time)",
    ),
    flag(
        "--no-role-switch",
        dest="allow_role_switch",
        action="store_false",
        default=AutoscaleConfig.allow_role_switch,
        help="never switch a worker between the pools (only add and drain)",
    ),
)


def autoscale_config_from_args(args: argparse.Namespace) -> AutoscaleConfig | None:
    """The config `AUTOSCALE_FLAGS` give (None without --autoscale)."""
    if not args.autoscale:
        return None
    return config_from_args(AutoscaleConfig, args, AUTOSCALE_FLAGS, slo=SLO.parse(args.slo))


# The router command's own: its workers, address and key (`serve` has its own of those).
ROUTER_FLAGS = (
    flag(
        "--prefill",
        nargs="*",
        default=[],
        metavar="URL",
        help="prefill worker URLs (none: decode workers prefill everything)",
    ),
    flag("--decode", nargs="+", required=True, metavar="URL", help="decode worker URLs"),
    flag("--host", default=RouterConfig.host),
    flag("--port", type=int, default=RouterConfig.port),
    flag(
        "--api-key",
        default=RouterConfig.api_key,
        help="require 'Authorization: Bearer KEY' on /v1/* and /workers",
    ),
    flag(
        "--block-size",
        type=int,
        default=RouterConfig.block_size,
        help="the workers' KV block size (prefix matching)",
    ),
    flag(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="tokenize prompts in the router with this model's tokenizer "
        "('default', a .gguf file or a Hugging Face folder); without it "
        "a worker's POST /tokenize is asked",
    ),
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route OpenAI requests across prefill and decode workers",
        description="Serve the OpenAI API in front of prefill and decode workers "
        "(pdserve serve --role prefill|decode).",
    )
    add_flags(parser, None, ROUTER_FLAGS)
    add_flags(parser, "routing", ROUTING_FLAGS)
    parser.set_defaults(run=run)


def router_config_from_args(
    args: argparse.Namespace,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    fleet_secret: str | None = None,
    fleet_tls: FleetTLS | None = None,
) -> RouterConfig:
    """A `RouterConfig` from `ROUTING_FLAGS` plus --host, --port, --api-key and --block-size
    (and the deployment's fleet secret and TLS credentials, which are never flags)."""
    return config_from_args(
        RouterConfig,
        args,
        ROUTING_FLAGS,
        prefill_urls=tuple(prefill_urls),
        decode_urls=tuple(decode_urls),
        prefill_policy=args.prefill_policy or args.policy,
        decode_policy=args.decode_policy or args.policy,
        kv_handoff=KVHandoff(args.kv_handoff),
        shared_kv_store=args.shared_kv_store or getattr(args, "kv_store", None) is not None,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        block_size=args.block_size,
        fleet_secret=fleet_secret,
        fleet_tls=fleet_tls,
    )


def serve_router(
    config: RouterConfig,
    tokenizer: PromptTokenizer | None = None,
    provisioner: Provisioner | None = None,
    autoscale: AutoscaleConfig | None = None,
    discover: Discover | None = None,
) -> None:
    """Run the router under uvicorn until SIGINT/SIGTERM (`provisioner`, `autoscale` and
    `discover` as `router.runtime.RouterRuntime` takes them)."""
    import uvicorn

    from pdserve.api.asgi import freeze_startup_heap
    from pdserve.router.app import build_app

    app = build_app(config, tokenizer, provisioner, autoscale, discover)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def run(args: argparse.Namespace) -> int:
    # Workers started by hand into a guarded deployment share its $PDSERVE_FLEET_SECRET.
    config = router_config_from_args(args, args.prefill, args.decode, fleet_secret_from_env())
    tokenizer = None
    if args.tokenizer is not None and config.needs_token_ids:
        tokenizer = LocalTokenizer.load(args.tokenizer)
    print(
        f"pdserve router: http://{config.host}:{config.port} "
        f"(prefill {len(config.prefill_urls)}, decode {len(config.decode_urls)})",
        file=sys.stderr,
        flush=True,
    )
    serve_router(config, tokenizer)
    return 0
