"""`Flag`: one command-line option, declared once in its package's flag tuple.

A leaf module (the standard library only), so every layer that declares flags — the engine,
the server, the router, the launcher, the simulator — takes it without importing the front
door (`pdserve.cli`) that registers the subcommands.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

Config = TypeVar("Config")


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

    def with_options(self, **changes: Any) -> Flag:
        """This option as another command declares it: the same name, type and meaning, with
        its own default or help (the simulator's defaults depend on the simulated device)."""
        return Flag(self.name, {**self.options, **changes})

    def argv(self, value: Any) -> list[str]:
        """The arguments that give this option `value` (none when it is the default)."""
        if value == self.default:
            return []
        if self.options.get("action") in ("store_true", "store_false"):
            return [self.name]
        if isinstance(value, list | tuple):
            return [self.name, *map(str, value)]
        return [self.name, str(value)]


def flag(name: str, **options: Any) -> Flag:
    """`Flag(name, options)` spelled like `add_argument(name, **options)`."""
    return Flag(name, options)


def add_flags(parser: argparse.ArgumentParser, title: str | None, flags: Iterable[Flag]) -> None:
    """Add `flags` to `parser`, under the help heading `title` (None: the parser's own)."""
    group = parser.add_argument_group(title) if title else parser
    for option in flags:
        group.add_argument(option.name, **option.options)


def config_from_args(
    config_type: type[Config], args: argparse.Namespace, flags: Iterable[Flag], **values: Any
) -> Config:
    """A `config_type` (a dataclass) from parsed `flags`: each field that a flag's `dest`
    names takes that flag's value; `values` give the fields no flag gives (or override)."""
    names = {f.name for f in dataclasses.fields(config_type)}
    given = {option.dest: getattr(args, option.dest) for option in flags if option.dest in names}
    return config_type(**{**given, **values})
