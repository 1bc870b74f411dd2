"""`pdserve router`: the disaggregated-serving gateway in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from functools import partial

from pdserve.router.config import RouterConfig
from pdserve.router.policies import POLICY_NAMES
from pdserve.router.tokenizer import LocalTokenizer, PromptTokenizer

# Seconds uvicorn lets in-flight streams finish after SIGINT/SIGTERM.
GRACEFUL_SHUTDOWN_S = 30


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route OpenAI requests across prefill and decode workers",
        description="Serve the OpenAI API in front of prefill and decode workers "
        "(pdserve serve --role prefill|decode).",
    )
    parser.add_argument(
        "--prefill",
        nargs="*",
        default=[],
        metavar="URL",
        help="prefill worker URLs (none: decode workers prefill everything)",
    )
    parser.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode worker URLs"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /workers"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="the workers' KV block size (prefix matching)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="tokenize prompts in the router with this model's tokenizer "
        "('default', a .gguf file or a Hugging Face folder); without it "
        "a worker's POST /tokenize is asked",
    )
    add_routing_args(parser)
    parser.set_defaults(run=run)


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    """Policy, threshold and health flags, shared with `pdserve serve --mode disagg`."""
    group = parser.add_argument_group("routing")
    add = partial(add_once, group)
    add(
        "--policy",
        choices=POLICY_NAMES,
        default="least_loaded",
        help="policy of both pools unless --prefill-policy/--decode-policy",
    )
    add("--prefill-policy", choices=POLICY_NAMES, default=None)
    add("--decode-policy", choices=POLICY_NAMES, default=None)
    add(
        "--local-prefill-threshold",
        type=int,
        default=0,
        metavar="N",
        help="prompts with fewer uncached tokens skip the prefill worker (0: all go through one)",
    )
    add(
        "--balance-factor",
        type=float,
        default=2.0,
        help="prefix_aware leaves the best match when its load exceeds this "
        "times the least loaded worker's",
    )
    add(
        "--health-check-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between GET /health rounds over the workers",
    )
    add("--health-check-timeout", type=float, default=5.0, metavar="SECONDS")
    add(
        "--unhealthy-threshold",
        type=int,
        default=2,
        help="failed health checks in a row that take a worker out of rotation",
    )
    add(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="bound on each leg's reads (default: none)",
    )


def add_once(group, *flags: str, **kwargs) -> None:
    """Add an option unless the parser already has one of its flags (parsers are composed:
    `pdserve serve` has worker flags of its own)."""
    with contextlib.suppress(argparse.ArgumentError):
        group.add_argument(*flags, **kwargs)


def router_config_from_args(
    args: argparse.Namespace, prefill_urls: Sequence[str], decode_urls: Sequence[str]
) -> RouterConfig:
    """A `RouterConfig` from `add_routing_args` flags plus host/port/api-key/block-size."""
    return RouterConfig(
        prefill_urls=tuple(prefill_urls),
        decode_urls=tuple(decode_urls),
        prefill_policy=args.prefill_policy or args.policy,
        decode_policy=args.decode_policy or args.policy,
        local_prefill_threshold=args.local_prefill_threshold,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        block_size=args.block_size,
        balance_factor=args.balance_factor,
        health_interval_s=args.health_check_interval,
        health_timeout_s=args.health_check_timeout,
        unhealthy_threshold=args.unhealthy_threshold,
        request_timeout_s=args.request_timeout,
    )


def serve_router(config: RouterConfig, tokenizer: PromptTokenizer | None = None) -> None:
    """Run the router under uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    from pdserve.router.app import build_app

    uvicorn.run(
        build_app(config, tokenizer),
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def run(args: argparse.Namespace) -> int:
    config = router_config_from_args(args, args.prefill, args.decode)
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
