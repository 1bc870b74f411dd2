"""The shared KV store: a prompt prefix is prefilled once per fleet, not once per worker.

Whole KV blocks are stored under their chained block hash (the block manager's, the same in
every process and host), salted with what the bytes mean and whose they are (`keys.py`);
each value carries a versioned, checksummed header that a reader checks against the request
before using a byte (`codec.py`). Two backends: a Redis (or Valkey) server shared by workers
on any host (`redis_backend.py`), and `local`, an embedded LRU in shared memory that every
process on a host opens (`local_backend.py`). `KVStore` (`store.py`) is what an engine uses:
lookups in one round trip, fetches into the cache, writes behind a bounded queue, a
fetch-or-recompute break-even (`policy.py`) and Prometheus metrics (`metrics.py`). A store
that is down, slow, emptied or corrupted only costs misses (`errors.py`).

Torch-free: the router and tools can import it.
"""

from pdserve.kv_store.config import KVStoreConfig
from pdserve.kv_store.errors import ErrorKind
from pdserve.kv_store.keys import BlockRef, LayoutFingerprint, block_refs
from pdserve.kv_store.metrics import KVStoreMetrics
from pdserve.kv_store.policy import FetchPolicy
from pdserve.kv_store.store import KVStore, cache_bytes

__all__ = [
    "BlockRef",
    "ErrorKind",
    "FetchPolicy",
    "KVStore",
    "KVStoreConfig",
    "KVStoreMetrics",
    "LayoutFingerprint",
    "block_refs",
    "cache_bytes",
]
