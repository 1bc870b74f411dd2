"""Process-wide CPU settings that make the forward pass run at memory speed, and CPU features.

glibc serves allocations above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
mmap()s, so every activation tensor of a prefill would be page-faulted in again on each op and
unmapped when freed: for a 512-token chunk that costs more than the arithmetic of an RMSNorm.
Raising the threshold keeps such buffers in the heap, where they are reused warm; raising the
trim threshold stops glibc from handing the heap top back to the kernel after each step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# CPU features with fast bfloat16 matmul in oneDNN (AMX tiles, or AVX-512 bf16 dot products).
BF16_MATMUL_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers up to this size come from the heap; the KV cache and weights above it stay mmapped.
_MMAP_THRESHOLD_BYTES = 256 * 2**20
_TRIM_THRESHOLD_BYTES = 1 * 2**30


@functools.cache
def tune_cpu_allocator() -> bool:
    """Set glibc's malloc thresholds once per process; False where glibc is not the allocator."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    is_set = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )
    logger.debug("glibc malloc thresholds %s", "set" if is_set else "not set")
    return is_set


@functools.cache
def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where /proc/cpuinfo is unavailable); read
    once per process."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()
