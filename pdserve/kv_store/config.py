"""`KVStoreConfig`: where the shared KV store is and how hard to try (`--kv-store*` flags)."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

LOCAL = "local"
# Namespaces salt keys; a bound keeps keys and log lines short.
MAX_NAMESPACE_LEN = 128
# URL scheme -> (module, class) of the `kv_store.backend.KVStoreBackend` it names, imported
# only when a URL names it (`create_backend`).
_BACKENDS: dict[str, tuple[str, str]] = {}


def register_backend(scheme: str, module: str, class_name: str) -> None:
    """Make `module.class_name` (a `KVStoreBackend`) the one `--kv-store SCHEME...` names."""
    if scheme in _BACKENDS:
        raise ValueError(f"KV store scheme {scheme!r} is registered already")
    _BACKENDS[scheme] = (module, class_name)


def backend_schemes() -> tuple[str, ...]:
    """Every scheme a `--kv-store` URL may have, `local` first."""
    return tuple(_BACKENDS)


# `local` and `local:DIR`: the embedded store in shared memory or in files under DIR.
register_backend(LOCAL, "pdserve.kv_store.local_backend", "LocalBackend")
for _scheme in ("redis", "rediss", "unix"):
    register_backend(_scheme, "pdserve.kv_store.redis_backend", "RedisBackend")


@dataclass(frozen=True)
class KVStoreConfig:
    """A store URL and its limits. Errors name the flag (`--kv-store...`).

    `url` is ``local`` (the embedded store in shared memory), ``local:DIR`` (the embedded
    store in files under DIR, e.g. on local SSD) or a Redis URL as redis-py reads it:
    ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS), ``unix://``.
    """

    url: str
    # Capacity of the embedded store (a Redis server's is its own `maxmemory`).
    max_gb: float = 4.0
    # Salts every key: two namespaces never read each other's blocks.
    namespace: str = ""
    # Per socket operation; a slower server counts as down for this call.
    timeout_s: float = 0.5
    # After a failure the backend is skipped (all misses) for a backoff that doubles per
    # consecutive failure, from `reconnect_backoff_s` up to `max_reconnect_backoff_s`.
    reconnect_backoff_s: float = 0.1
    max_reconnect_backoff_s: float = 5.0
    # Bytes of blocks waiting to be written; past it new writes are dropped (and counted).
    write_queue_mb: float = 256.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError("--kv-store must be 'local', 'local:DIR' or a redis:// URL")
        if self.scheme not in backend_schemes():
            url_schemes = [s + "://" for s in backend_schemes() if s != LOCAL]
            raise ValueError(
                f"--kv-store must be 'local', 'local:DIR' or a URL with scheme "
                f"{', '.join(url_schemes)}; got {self.redacted_url!r}"
            )
        elif self.url != LOCAL and not self.url.removeprefix(LOCAL + ":"):
            raise ValueError("--kv-store local:DIR needs a directory after 'local:'")
        if not self.max_gb > 0:
            raise ValueError(f"--kv-store-max-gb must be positive, got {self.max_gb}")
        if len(self.namespace) > MAX_NAMESPACE_LEN:
            raise ValueError(f"--kv-store-namespace is longer than {MAX_NAMESPACE_LEN} characters")
        for name in ("timeout_s", "reconnect_backoff_s", "max_reconnect_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv store {name} must be positive, got {getattr(self, name)}")
        if not self.write_queue_mb > 0:
            raise ValueError(f"kv store write_queue_mb must be positive, got {self.write_queue_mb}")

    @property
    def backend(self) -> tuple[str, str]:
        """The module and class of the backend the URL names."""
        return _BACKENDS[self.scheme]

    @property
    def scheme(self) -> str:
        """What names the backend: ``local``, or the URL's scheme."""
        return LOCAL if self.is_local else urlsplit(self.url).scheme

    @property
    def is_local(self) -> bool:
        return self.url == LOCAL or self.url.startswith(LOCAL + ":")

    @property
    def local_dir(self) -> str:
        """Where the embedded store's segment files live: shared memory unless told."""
        if self.url != LOCAL:
            return self.url.removeprefix(LOCAL + ":")
        return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    @property
    def redacted_url(self) -> str:
        """The URL with any password replaced, for logs and error messages."""
        parts = urlsplit(self.url)
        userinfo, at, hostport = parts.netloc.rpartition("@")
        if at and ":" in userinfo:
            parts = parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hostport}")
        # unix://...?password=...
        return urlunsplit(parts._replace(query=re.sub(r"(password=)[^&]*", r"\1***", parts.query)))
