"""Rendering a model's Jinja chat template the way Hugging Face transformers does.

Templates come from model files, so they run in jinja2's immutable sandbox. The environment
offers what published templates rely on: `raise_exception`, `strftime_now`, a `tojson` filter
that keeps non-ASCII text, loop controls, and the special tokens as variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (or could not render it)."""


class ChatTemplate:
    """A compiled chat template. `source` errors raise `jinja2.TemplateSyntaxError`."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (dicts with "role" and "content")."""
        variables = {"tools": None, "documents": None, **self._special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
