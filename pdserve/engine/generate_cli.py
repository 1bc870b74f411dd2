"""`pdserve generate`: one prompt in, only the generated text on stdout."""

from __future__ import annotations

import argparse
import sys

from pdserve.core.config import SchedulerConfig, SchedulingPolicy
from pdserve.core.sampling_params import InvalidParameterError, SamplingParams
from pdserve.engine.args import ENGINE_FLAGS
from pdserve.flags import add_flags


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt (offline)")
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument(
        "--mode",
        choices=[policy.value for policy in SchedulingPolicy],
        default=SchedulerConfig.scheduling.value,
    )
    add_flags(parser, "engine", ENGINE_FLAGS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.args import engine_config_from_args
    from pdserve.engine.llm import LLM

    if not args.prompt.strip():
        raise InvalidParameterError("prompt", "must not be empty")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    llm = LLM.from_config(engine_config_from_args(args))
    if args.chat:
        result = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        result = llm.generate(args.prompt, params, use_tqdm=False)[0]
    sys.stdout.write(result.text + "\n")
    return 0
