"""The `pdserve` command: generate, serve, router, bench, simulate, plan, export-hf.

Each subcommand lives with its package and registers itself through `add_parser`; user errors
(bad model files, bad parameters) print one line on stderr and exit non-zero, no traceback.
Options shared between subcommands, or handed on to child processes, are declared once as
`Flag`s.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Modules exposing add_parser(subparsers) and run(args) -> int, in help order.
SUBCOMMAND_MODULES = (
    "pdserve.engine.generate_cli",
    "pdserve.launch.cli",
    "pdserve.router.cli",
    "pdserve.bench.cli",
    "pdserve.sim.cli",
    "pdserve.model.export_cli",
)


@dataclass(frozen=True)
class Flag:
    """One command-line option, declared once: added to any parser that takes it, and turned
    back into arguments to hand its value on to a child process (a worker)."""

    name: str  # "--max-num-seqs"
    options: Mapping[str, Any] = field(default_factory=dict)  # add_argument's keywords

    @property
    def dest(self) -> str:
        return self.options.get("dest", self.name.removeprefix("--").replace("-", "_"))

    @property
    def default(self) -> Any:
        return self.options.get("default")

    def argv(self, value: Any) -> list[str]:
        """The arguments that give this option `value` (none when it is the default)."""
        if value == self.default:
            return []
        if self.options.get("action") in ("store_true", "store_false"):
            return [self.name]
        if isinstance(value, list | tuple):
            return [self.name, *map(str, value)]
        return [self.name, str(value)]


class MissingExtraError(RuntimeError):
    """A dependency the command needs is not installed; the message says what to install."""


def flag(name: str, **options: Any) -> Flag:
    """`Flag(name, options)` spelled like `add_argument(name, **options)`."""
    return Flag(name, options)


def add_flags(parser: argparse.ArgumentParser, title: str | None, flags: Iterable[Flag]) -> None:
    """Add `flags` to `parser`, under the help heading `title` (None: the parser's own)."""
    group = parser.add_argument_group(title) if title else parser
    for option in flags:
        group.add_argument(option.name, **option.options)


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
    except (ModelLoadError, InvalidParameterError, MissingExtraError, OSError, ValueError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
