"""`create_kv_transport`: the one call an engine makes to take part in KV transfer."""

from __future__ import annotations

import torch

from pdserve.kv_transfer.blocks import TORCH_DTYPES
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import KVLayout
from pdserve.kv_transfer.shm import ShmTransport
from pdserve.kv_transfer.shm_segment import SharedKVCache
from pdserve.kv_transfer.tcp import TcpTransport
from pdserve.kv_transfer.transport import KVTransport


def create_kv_transport(config: KVTransferConfig, layout: KVLayout, num_blocks: int) -> KVTransport:
    """Allocate the engine's KV cache (CPU memory) and the transport that moves it.

    The engine must use `transport.kv_cache` as its KV cache tensor (for a shm producer it
    lives in shared memory).
    """
    leases = LeaseManager(config.kv_lease_timeout) if config.is_producer else None
    if config.transport == "tcp":
        # zero_() rather than torch.zeros: writing every page now means no transfer ever pays
        # for first-touch page faults (torch.zeros may hand back lazily-zeroed pages).
        cache = torch.empty(
            layout.cache_shape(num_blocks), dtype=TORCH_DTYPES[layout.dtype]
        ).zero_()
        return TcpTransport(cache, layout, config, leases)
    return ShmTransport(SharedKVCache.create(layout, num_blocks), layout, config, leases)
