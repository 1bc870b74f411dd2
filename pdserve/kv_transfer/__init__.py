"""KV-transfer data plane for disaggregated prefill/decode.

Pure-Python parts (importable by the router and scheduler without torch) are re-exported
here: the hand-off schema, config, leases, transfer units and errors. The torch parts live in
their modules: `factory.create_kv_transport`, `transport.KVTransport`, `shm.ShmTransport`,
`tcp.TcpTransport`, `shm_segment.SharedKVCache`, `blocks.layout_of`.
"""

from pdserve.kv_transfer.config import KVRole, KVTransferConfig
from pdserve.kv_transfer.errors import (
    FrameError,
    KVIncompatibleError,
    KVLeaseError,
    KVProtocolError,
    KVTransferError,
)
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import (
    KV_TRANSFER_PROTOCOL_VERSION,
    KVLayout,
    KVTransferParams,
    check_compatible,
)
from pdserve.kv_transfer.unit import KVTransferUnit, plan_units

__all__ = [
    "KV_TRANSFER_PROTOCOL_VERSION",
    "FrameError",
    "KVIncompatibleError",
    "KVLayout",
    "KVLeaseError",
    "KVProtocolError",
    "KVRole",
    "KVTransferConfig",
    "KVTransferError",
    "KVTransferParams",
    "KVTransferUnit",
    "LeaseManager",
    "check_compatible",
    "plan_units",
]
