"""The `pdserve` command: generate, serve, router, bench, simulate, plan, export-hf.

Each subcommand lives with its package and registers itself through `add_parser`; user errors
(bad model files, bad parameters) print one line on stderr and exit non-zero, no traceback.
Options shared between subcommands, or handed on to child processes, are declared once as
`Flag`s (`pdserve.flags`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules exposing add_parser(subparsers) and run(args) -> int, in help order.
SUBCOMMAND_MODULES = (
    "pdserve.engine.generate_cli",
    "pdserve.launch.cli",
    "pdserve.router.cli",
    "pdserve.bench.cli",
    "pdserve.sim.cli",
    "pdserve.model.export_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from pdserve.core.sampling_params import InvalidParameterError
    from pdserve.model.config import ModelLoadError

    try:
        return args.run(args)
    except (ModelLoadError, InvalidParameterError, OSError, ValueError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
