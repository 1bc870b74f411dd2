"""`ShmTransport`: same-host KV transfer through shared memory, no sockets on the data path.

The producer's whole KV cache lives in a `SharedKVCache` segment. A consumer maps it once per
producer and copies leased blocks straight from it into its own cache: the bytes are copied
exactly once, with no round trip before the copy. Validity is settled afterwards by RELEASE:
the producer answers `released: true` only if the lease was still live (see lease.py), which
proves the blocks were not reused while they were copied; otherwise `receive()` refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pdserve.kv_transfer.blocks import copy_blocks
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.errors import KVProtocolError
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import KVLayout, KVTransferParams
from pdserve.kv_transfer.shm_segment import SharedKVCache
from pdserve.kv_transfer.transport import KVTransport, RemoteEngine
from pdserve.kv_transfer.unit import KVTransferUnit


class ShmTransport(KVTransport):
    """Shared-memory transport. A producer's `kv_cache` must be `segment.tensor`."""

    name: ClassVar[str] = "shm"

    def __init__(
        self,
        segment: SharedKVCache,
        layout: KVLayout,
        config: KVTransferConfig,
        leases: LeaseManager | None = None,
    ) -> None:
        self.segment = segment
        super().__init__(segment.tensor, layout, config, leases)

    def close(self) -> None:
        super().close()
        self.segment.close()

    def _hello_extra(self) -> dict[str, Any]:
        return {"shm_name": self.segment.name}

    def _params_extra(self) -> dict[str, Any]:
        return {"shm_name": self.segment.name}

    def _attach(self, remote: RemoteEngine, params: KVTransferParams) -> SharedKVCache:
        if remote.hello.get("shm_name") != params.shm_name:
            raise KVProtocolError(
                f"kv_transfer_params.shm_name {params.shm_name!r} is not the "
                f"segment of engine {remote.engine_id}"
            )
        mapped = SharedKVCache.attach(params.shm_name, remote.layout)
        if mapped.num_blocks != remote.num_blocks:
            raise KVProtocolError(
                f"shm segment {params.shm_name} holds {mapped.num_blocks} "
                f"blocks, the engine reports {remote.num_blocks}"
            )
        return mapped

    def _read_units(
        self, remote: RemoteEngine, request_id: str, units: Sequence[KVTransferUnit]
    ) -> int:
        source = remote.attachment.tensor
        num_bytes = 0
        for unit in units:
            if max(unit.remote_block_ids) >= remote.num_blocks:
                raise KVProtocolError(
                    f"unit.remote_block_ids exceed the {remote.num_blocks} "
                    f"blocks of engine {remote.engine_id}"
                )
            layers = slice(unit.layer_start, unit.layer_end)
            copy_blocks(
                self.kv_cache[layers], unit.local_block_ids, source[layers], unit.remote_block_ids
            )
            num_bytes += self.layout.nbytes(unit.num_blocks, unit.num_layers)
        return num_bytes
