"""`TcpTransport`: KV transfer across hosts as framed raw tensor bytes (see wire.py).

For each unit the receiver sends FETCH and reads one DATA frame: the unit's blocks layer by
layer, each layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. It receives one
layer at a time into a small reusable staging buffer and scatters it into its cache, so memory
stays bounded and the scatter reads from CPU cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pdserve.kv_transfer.blocks import StagedBlocks, byte_view
from pdserve.kv_transfer.errors import FrameError
from pdserve.kv_transfer.transport import KVTransport, RemoteEngine
from pdserve.kv_transfer.unit import KVTransferUnit
from pdserve.kv_transfer.wire import MessageType


class TcpTransport(KVTransport):
    """TCP transport: the producer's KV server sends the bytes; any `kv_cache` works."""

    name: ClassVar[str] = "tcp"

    def _read_units(
        self, remote: RemoteEngine, request_id: str, units: Sequence[KVTransferUnit]
    ) -> int:
        return sum(self._read_unit(remote, request_id, unit) for unit in units)

    def _read_unit(self, remote: RemoteEngine, request_id: str, unit: KVTransferUnit) -> int:
        num_bytes = self.layout.nbytes(unit.num_blocks, unit.num_layers)
        meta = remote.client.call(
            MessageType.FETCH,
            {
                "request_id": request_id,
                "layer_start": unit.layer_start,
                "layer_end": unit.layer_end,
                "block_ids": list(unit.remote_block_ids),
            },
            expect=MessageType.DATA,
            payload_len=num_bytes,
        )
        layer = remote.staging.layer(unit.num_blocks)
        expected = {"dtype": self.layout.dtype, "shape": [unit.num_layers, *layer.shape[1:]]}
        if meta != expected:
            remote.client.close()  # the payload is still on the wire
            raise FrameError(
                f"KV server {remote.client.address} sent DATA {meta}, expected {expected}"
            )
        blocks = StagedBlocks(unit.local_block_ids)
        for index in range(unit.layer_start, unit.layer_end):
            remote.client.recv_into(byte_view(layer))
            blocks.scatter(self.kv_cache[index : index + 1], layer)
        return num_bytes
