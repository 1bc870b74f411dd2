"""`KVTransferUnit`: the grain of a transfer, a layer range of a set of blocks.

A whole-request transfer is one unit covering every layer. The same type expresses the
overlapped transfers to come: one unit per layer (or layer group) as prefill finishes that
layer, or one unit per prompt chunk's blocks as chunked prefill completes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv_transfer.errors import KVProtocolError
from pdserve.kv_transfer.fields import check_int


@dataclass(frozen=True)
class KVTransferUnit:
    """Layers ``[layer_start, layer_end)`` of blocks: ``remote_block_ids[i]`` on the sender
    goes to ``local_block_ids[i]`` on the receiver, for K and V."""

    layer_start: int
    layer_end: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        object.__setattr__(self, "local_block_ids", tuple(self.local_block_ids))
        check_int(self.layer_start, "unit.layer_start")
        check_int(self.layer_end, "unit.layer_end", min_value=self.layer_start + 1)
        if len(self.remote_block_ids) != len(self.local_block_ids):
            raise KVProtocolError(
                f"unit has {len(self.remote_block_ids)} remote block ids but "
                f"{len(self.local_block_ids)} local block ids"
            )
        if not self.remote_block_ids:
            raise KVProtocolError("unit names no blocks")
        for name, ids in (("remote", self.remote_block_ids), ("local", self.local_block_ids)):
            for block_id in ids:
                check_int(block_id, f"unit.{name}_block_ids[]")
            if len(set(ids)) != len(ids):
                raise KVProtocolError(f"unit.{name}_block_ids has duplicates")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)


def plan_units(
    num_layers: int,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    layers_per_unit: int | None = None,
) -> list[KVTransferUnit]:
    """Split a request's transfer into units: one for all layers (`layers_per_unit` None),
    else consecutive layer groups of that size."""
    step = num_layers if layers_per_unit is None else layers_per_unit
    check_int(step, "layers_per_unit", min_value=1)
    return [
        KVTransferUnit(
            start, min(start + step, num_layers), tuple(remote_block_ids), tuple(local_block_ids)
        )
        for start in range(0, num_layers, step)
    ]
