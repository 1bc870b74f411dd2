"""`KVStoreConfig`: where the shared KV store is and how hard to try (`--kv-store*` flags)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from pdserve.kv_store.keys import NAMESPACE_PATTERN
from pdserve.redaction import redact_url

LOCAL = "local"
# Namespaces salt keys; a bound keeps keys and log lines short.
MAX_NAMESPACE_LEN = 128
# The store's password where argv (readable by every user of the host) does not show it; a
# deployment's launcher hands it to its workers here too.
KV_STORE_PASSWORD_ENV = "PDSERVE_KV_STORE_PASSWORD"
# The namespace's secret (`keys.KeyScheme`), kept out of argv the same way.
KV_STORE_NAMESPACE_SECRET_ENV = "PDSERVE_KV_STORE_NAMESPACE_SECRET"
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
    `password` (from `$PDSERVE_KV_STORE_PASSWORD` or `--kv-store-password-file`, `read_password`)
    is the Redis password for a URL without one (with a user name: that ACL user's).
    `namespace_secret` (`$PDSERVE_KV_STORE_NAMESPACE_SECRET` or
    `--kv-store-namespace-secret-file`) keys the namespace's salt: see `keys.KeyScheme`.
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
    # How long a reader waits for blocks another worker announced it is writing (in-flight
    # markers, which expire after as long) before computing them itself: past it, the write
    # is taken as lost.
    pending_write_wait_s: float = 1.0
    password: str | None = field(default=None, repr=False)
    namespace_secret: str | None = field(default=None, repr=False)

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
        if not NAMESPACE_PATTERN.fullmatch(self.namespace):
            raise ValueError(
                "--kv-store-namespace may hold only letters, digits, '_', '.' and '-' (it is "
                f"part of every key and of Redis ACL key patterns); got {self.namespace!r}"
            )
        for name in ("timeout_s", "reconnect_backoff_s", "max_reconnect_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv store {name} must be positive, got {getattr(self, name)}")
        if not self.pending_write_wait_s >= 0:
            raise ValueError(
                f"kv store pending_write_wait_s must be >= 0, got {self.pending_write_wait_s}"
            )
        if not self.write_queue_mb > 0:
            raise ValueError(f"kv store write_queue_mb must be positive, got {self.write_queue_mb}")
        if self.password is not None and split_password(self.url)[1] is not None:
            raise ValueError(
                f"--kv-store {self.redacted_url} has a password and another was given "
                f"(${KV_STORE_PASSWORD_ENV} or --kv-store-password-file): give it once"
            )

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
        return redact_url(self.url)


def split_password(url: str) -> tuple[str, str | None]:
    """`url` without the password in its user part (the user name kept), and that password
    (None: it has none)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url, None
    user, password = userinfo.split(":", 1)
    netloc = f"{user}@{hostport}" if user else hostport
    return parts._replace(netloc=netloc).geturl(), unquote(password)


def read_password(password_file: str | None) -> str | None:
    """The store password from `password_file`, else from `$PDSERVE_KV_STORE_PASSWORD`."""
    return read_secret(KV_STORE_PASSWORD_ENV, password_file, "--kv-store-password-file")


def read_namespace_secret(secret_file: str | None) -> str | None:
    """The namespace's secret from `secret_file`, else `$PDSERVE_KV_STORE_NAMESPACE_SECRET`."""
    return read_secret(
        KV_STORE_NAMESPACE_SECRET_ENV, secret_file, "--kv-store-namespace-secret-file"
    )


def read_secret(env: str, path: str | None, flag: str) -> str | None:
    """A secret from the file at `path` (its first line), else taken out of `$env`, so that
    nothing this process starts inherits it; None when neither gives one."""
    from_env = os.environ.pop(env, None) or None
    if path is None:
        return from_env
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc}") from None
    if not secret:
        raise ValueError(f"{flag}: {path} is empty")
    return secret
