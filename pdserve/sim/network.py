"""Interconnect catalog: bandwidth per lane (one direction), lanes per node, latency, and the
share of the line rate transfers reach.

Bandwidths are line rates from vendor spec sheets, one direction (NVLink's headline figures
are bidirectional and are halved here). Where a published measurement exists, `efficiency`
and `latency_s` are fitted to it (`benchmarks/gpu_calibration.py`, points in
`sim/data/sources/`, residuals in docs/calibrations.md); elsewhere they are assumptions,
marked so: `ASSUMED_EFFICIENCY` and typical one-way latencies of the transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sim.errors import SimConfigError

GBIT = 1e9 / 8  # bytes/s in one Gb/s
GBYTE = 1e9
# A link no published measurement covers reaches this share of its line rate (assumed).
ASSUMED_EFFICIENCY = 0.9


@dataclass(frozen=True)
class Interconnect:
    """A link: `num_lanes` lanes per node, each `bandwidth` bytes/s in one direction (line
    rate), of which large transfers reach `efficiency`.

    A transfer from a tensor-parallel group of `tp` devices uses at most `min(tp, num_lanes)`
    lanes (each device drives its own NIC); concurrent transfers from one node share the
    node's lanes. `measured_by` names the source `efficiency` and `latency_s` were fitted
    to (None: assumed).
    """

    name: str
    bandwidth: float
    latency_s: float
    num_lanes: int = 1
    efficiency: float = ASSUMED_EFFICIENCY
    measured_by: str | None = None

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise SimConfigError(f"network {self.name}: bandwidth must be positive")
        if self.latency_s < 0:
            raise SimConfigError(f"network {self.name}: latency_s must be >= 0")
        if self.num_lanes < 1:
            raise SimConfigError(f"network {self.name}: num_lanes must be >= 1")
        if not 0 < self.efficiency <= 1:
            raise SimConfigError(f"network {self.name}: efficiency must be in (0, 1]")

    @property
    def achieved_bandwidth(self) -> float:
        """Bytes/s one lane carries in practice: line rate × efficiency."""
        return self.bandwidth * self.efficiency

    @property
    def node_bandwidth(self) -> float:
        """Bytes/s one node achieves through this link with every lane busy."""
        return self.achieved_bandwidth * self.num_lanes

    def transfer_bandwidth(self, num_devices: int) -> float:
        """Bytes/s one transfer from a group of `num_devices` devices achieves alone."""
        return self.achieved_bandwidth * min(num_devices, self.num_lanes)


NETWORKS: dict[str, Interconnect] = {
    link.name: link
    for link in (
        # NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU -> 450 GB/s each way,
        # every GPU of the 8-GPU board its own lane through the NVSwitches. Efficiency and
        # latency: NCCL all-reduces of 2 KiB-64 MiB over 4 and 8 H100s (Vidur's profiles).
        Interconnect(
            "nvlink-h100", 450 * GBYTE, 34e-6, 8, efficiency=0.88, measured_by="vidur-allreduce"
        ),
        # NVLink 3 (A100 SXM): 600 GB/s bidirectional -> 300 GB/s each way; as above, over
        # 4 and 8 A100s.
        Interconnect(
            "nvlink-a100", 300 * GBYTE, 58e-6, 8, efficiency=0.60, measured_by="vidur-allreduce"
        ),
        # NVLink 5 (B200): 1.8 TB/s bidirectional -> 900 GB/s each way.
        Interconnect("nvlink-b200", 900 * GBYTE, 5e-6, num_lanes=8),
        # PCIe Gen4 x16 per card (L40S has no NVLink): 32 GB/s each way.
        Interconnect("pcie-gen4", 32 * GBYTE, 10e-6, num_lanes=8),
        # One NDR InfiniBand port (ConnectX-7): 400 Gb/s, one NIC per node.
        Interconnect("ib-400", 400 * GBIT, 5e-6),
        # DGX/HGX H100 compute fabric: eight 400 Gb/s NDR ports per node, one per GPU.
        Interconnect("ib-8x400", 400 * GBIT, 5e-6, num_lanes=8),
        # RDMA over Converged Ethernet at 100 Gb/s and at 400 Gb/s (one NIC per node).
        Interconnect("roce-100", 100 * GBIT, 10e-6),
        Interconnect("roce-400", 400 * GBIT, 10e-6),
        # RoCE with four 200 Gb/s and eight 400 Gb/s NICs per node: Mooncake's Transfer
        # Engine moved 40 GB at 87 GB/s and 190 GB/s over them (its README).
        Interconnect(
            "roce-4x200", 200 * GBIT, 10e-6, 4, efficiency=0.87, measured_by="mooncake-te"
        ),
        Interconnect(
            "roce-8x400", 400 * GBIT, 10e-6, 8, efficiency=0.475, measured_by="mooncake-te"
        ),
        # Commodity 25 Gb/s Ethernet with TCP.
        Interconnect("eth-25", 25 * GBIT, 50e-6),
        # Shared memory between worker processes on the local CPU: a memcpy bounded by one
        # core's DRAM bandwidth (the brief's 16 GB/s), plus a wake-up of the receiver; the
        # CPU's efficiency factors scale it (`efficiency.CPU_DEFAULT`).
        Interconnect("shm", 16 * GBYTE, 50e-6, efficiency=1.0),
    )
}


def get_network(spec: str) -> Interconnect:
    """A catalog link by name, or an ad-hoc one from a number of Gb/s (e.g. "200")."""
    by_lower = {key.lower(): link for key, link in NETWORKS.items()}
    if spec.lower() in by_lower:
        return by_lower[spec.lower()]
    try:
        gbps = float(spec.lower().removesuffix("gbps"))
    except ValueError:
        raise SimConfigError(
            f"--network: unknown link {spec!r}; give a number of Gb/s or one of "
            f"{', '.join(sorted(NETWORKS))}"
        ) from None
    if not gbps > 0:
        raise SimConfigError(f"--network: bandwidth must be positive, got {spec!r}")
    return Interconnect(f"{gbps:g}gbps", gbps * GBIT, 10e-6)
