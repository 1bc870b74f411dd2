"""Secrets out of what is logged, printed or saved: URLs' passwords and secret flags' values.

A leaf module (imports nothing of pdserve), so any layer may redact with it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

REDACTED = "***"
# Words of a flag's or variable's name that say its value is a secret (--api-key,
# --kv-store-password, PDSERVE_FLEET_SECRET=..., --hf-token), unless the name ends in one that
# says the value is where the secret is (--kv-store-password-file).
_SECRET_WORDS = frozenset({"key", "password", "passwd", "secret", "token"})
_WHERE_WORDS = frozenset({"file", "path", "dir", "env"})
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.I)
_USER_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/?#@:]*):[^/?#]*@", re.I)
_QUERY_SECRET = re.compile(r"([?&](?:password|token|key)=)[^&#]*", re.I)


def redact_url(url: str) -> str:
    """`url` with any password (in its user part or a ``password=`` query) replaced."""
    url = _USER_PASSWORD.sub(rf"\1:{REDACTED}@", url)
    return _QUERY_SECRET.sub(rf"\1{REDACTED}", url)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """`argv` with the values of secret flags (``--api-key X``, ``--api-key=X``,
    ``NAME_SECRET=X``) and URLs' passwords replaced; an argument holding a command line of its
    own (``--worker-args '--api-key X'``) is redacted inside."""
    redacted: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            redacted.append(REDACTED)
        else:
            redacted.append(_redact_arg(arg))
        hide_next = arg.startswith("-") and "=" not in arg and _is_secret_name(arg)
    return redacted


def _is_secret_name(name: str) -> bool:
    words = re.split(r"[-_]+", name.strip("-").lower())
    return bool(_SECRET_WORDS.intersection(words)) and words[-1] not in _WHERE_WORDS


def _redact_arg(arg: str) -> str:
    name, eq, _ = arg.partition("=")
    if eq and " " not in name and "://" not in name and _is_secret_name(name):
        return f"{name}={REDACTED}"
    if " " in arg:
        try:
            inner = shlex.split(arg)
        except ValueError:
            inner = None
        if inner and len(inner) > 1:
            return shlex.join(redact_argv(inner))
    return _URL.sub(lambda m: redact_url(m.group(0)), arg)
