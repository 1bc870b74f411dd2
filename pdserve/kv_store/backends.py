"""The store's backends, by the `--kv-store` URL that names them.

Apart from `backend` (the interface) so that the backends import the interface and this
module imports the backends: each is loaded only when a URL names it.
"""

from __future__ import annotations

from pdserve.kv_store.backend import KVStoreBackend
from pdserve.kv_store.config import KVStoreConfig


def create_backend(config: KVStoreConfig, salt: str, value_nbytes: int) -> KVStoreBackend:
    """The backend `config.url` names. `salt` names the embedded store's segment (one per
    namespace and layout), whose slots hold `value_nbytes` each."""
    if config.is_local:
        from pdserve.kv_store.local_backend import LocalBackend

        return LocalBackend(config.local_dir, salt, value_nbytes, config.max_gb)
    from pdserve.kv_store.redis_backend import RedisBackend

    return RedisBackend(config)
