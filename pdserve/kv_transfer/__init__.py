"""KV-transfer data plane for disaggregated prefill/decode.

Pure-Python parts (importable by the router and scheduler without torch) are re-exported
here: the hand-off schema, config, leases, transfer units and errors (`protocol`, `config`,
`lease`; the control channel's frames and client, `wire` and `client`, are torch-free too).
The torch parts live in their modules: `connector.KVConnector` and `create_kv_transport`,
`transport.KVTransport` and `TcpTransport`, `shm.ShmTransport` and `SharedKVCache`,
`server.KVServer`, `blocks.layout_of`.
"""

from pdserve.kv_transfer.config import KVRole, KVTransferConfig
from pdserve.kv_transfer.lease import LeaseManager
from pdserve.kv_transfer.protocol import (
    KV_TRANSFER_PROTOCOL_VERSION,
    FrameError,
    KVAuthError,
    KVIncompatibleError,
    KVLayout,
    KVLeaseError,
    KVProtocolError,
    KVTransferError,
    KVTransferParams,
    KVTransferUnit,
    check_compatible,
    plan_units,
)

__all__ = [
    "KV_TRANSFER_PROTOCOL_VERSION",
    "FrameError",
    "KVAuthError",
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
