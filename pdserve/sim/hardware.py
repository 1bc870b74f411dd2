"""Accelerator catalog: peak dense FLOP/s, memory bandwidth and capacity per device.

Numbers are vendor spec-sheet figures for dense math (no 2:4 sparsity). A `Hardware` is one
device: the unit a tensor-parallel group is made of. "cpu-local" is one core of the local
machine (the engine pins one worker per core; "cpu-local:2" is a worker on both cores); its
defaults are replaced by calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sim.errors import SimConfigError

GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One device (GPU, or one CPU core for "cpu-local")."""

    name: str
    peak_bf16_flops: float
    # None where the device has no FP8 tensor cores (A100, CPUs).
    peak_fp8_flops: float | None
    # Bytes/s of the device's own memory (HBM, GDDR, or DRAM share).
    memory_bandwidth: float
    memory_capacity: float
    # Interconnect name (network catalog) joining devices inside one node.
    intra_node_link: str
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("peak_bf16_flops", "memory_bandwidth", "memory_capacity"):
            if not getattr(self, name) > 0:
                raise SimConfigError(f"hardware {self.name}: {name} must be positive")
        if self.peak_fp8_flops is not None and not self.peak_fp8_flops > 0:
            raise SimConfigError(f"hardware {self.name}: peak_fp8_flops must be positive")
        if self.devices_per_node < 1:
            raise SimConfigError(f"hardware {self.name}: devices_per_node must be >= 1")

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for matmuls whose weights are stored in `dtype`."""
        if dtype == "bf16":
            return self.peak_bf16_flops
        if dtype == "fp8":
            if self.peak_fp8_flops is None:
                raise SimConfigError(f"hardware {self.name} has no FP8 tensor cores")
            return self.peak_fp8_flops
        raise SimConfigError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")


HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 989 TFLOPS, FP8 1,979 TFLOPS
        # (dense; the sheet's 1,979/3,958 figures are with sparsity), 80 GB HBM3 at 3.35 TB/s.
        Hardware("H100-SXM", 989 * TFLOPS, 1979 * TFLOPS, 3.35 * TB, 80 * GB, "nvlink-h100"),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM,
        # 141 GB HBM3e at 4.8 TB/s.
        Hardware("H200", 989 * TFLOPS, 1979 * TFLOPS, 4.8 * TB, 141 * GB, "nvlink-h100"),
        # NVIDIA A100 datasheet (80GB SXM): BF16 312 TFLOPS dense, no FP8,
        # HBM2e 2,039 GB/s, 80 GB; NVLink 3 at 600 GB/s bidirectional.
        Hardware("A100-80GB", 312 * TFLOPS, None, 2.039 * TB, 80 * GB, "nvlink-a100"),
        # NVIDIA L40S datasheet: BF16 362 TFLOPS, FP8 733 TFLOPS (dense), 48 GB GDDR6 at
        # 864 GB/s; no NVLink, PCIe Gen4 x16 between cards.
        Hardware("L40S", 362 * TFLOPS, 733 * TFLOPS, 0.864 * TB, 48 * GB, "pcie-gen4"),
        # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 (sparse) for 8 GPUs -> 4.5 PFLOPS dense
        # FP8 and 2.25 PFLOPS dense BF16 per GPU; 1,440 GB HBM3e (180 GB/GPU) at 8 TB/s/GPU.
        Hardware("B200", 2250 * TFLOPS, 4500 * TFLOPS, 8.0 * TB, 180 * GB, "nvlink-b200"),
    )
}
# The local machine's cores, nominally (the brief's figures: AMX bf16 tiles give ~1 TFLOP/s
# per core at best, ~16 GB/s of DRAM bandwidth per core). The CI machines are AMD EPYCs with
# AVX-512 bf16 but no AMX (~200 GFLOP/s per core in oneDNN): calibration finds that as a
# linear efficiency near 0.2 of this peak.
LOCAL_CPU_CORES = 2
CPU_CORE_FLOPS = 1 * TFLOPS
CPU_CORE_BANDWIDTH = 16 * GB
# What one engine worker may hold in weights and KV (the engine caps KV separately).
CPU_WORKER_MEMORY = 8 * GB


def local_cpu(num_cores: int = 1) -> Hardware:
    """An engine worker on `num_cores` cores of the local CPU, as one "device"."""
    if not 1 <= num_cores <= LOCAL_CPU_CORES:
        raise SimConfigError(f"--hardware cpu-local:N takes 1 to {LOCAL_CPU_CORES} cores")
    name = "cpu-local" if num_cores == 1 else f"cpu-local:{num_cores}"
    return Hardware(
        name,
        num_cores * CPU_CORE_FLOPS,
        None,
        num_cores * CPU_CORE_BANDWIDTH,
        CPU_WORKER_MEMORY,
        "shm",
        devices_per_node=LOCAL_CPU_CORES // num_cores,
    )


HARDWARE["cpu-local"] = local_cpu(1)

_ALIASES = {"h100": "H100-SXM", "a100": "A100-80GB", "cpu": "cpu-local"}


def get_hardware(name: str) -> Hardware:
    """Look a device up by catalog name (case-insensitive; H100/A100/cpu are aliases;
    "cpu-local:N" is a worker on N local cores)."""
    by_lower = {key.lower(): hw for key, hw in HARDWARE.items()}
    key = _ALIASES.get(name.lower(), name).lower()
    if key.startswith("cpu-local:") and key.removeprefix("cpu-local:").isdigit():
        return local_cpu(int(key.removeprefix("cpu-local:")))
    if key not in by_lower:
        raise SimConfigError(
            f"--hardware: unknown device {name!r}; known: {', '.join(sorted(HARDWARE))}"
        )
    return by_lower[key]
