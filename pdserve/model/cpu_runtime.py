"""Process-wide CPU settings that make the forward pass run at memory speed, and CPU features.

glibc serves allocations above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
mmap()s, so every activation tensor of a prefill would be page-faulted in again on each op and
unmapped when freed: for a 512-token chunk that costs more than the arithmetic of an RMSNorm.
Raising the threshold keeps such buffers in the heap, where they are reused warm; raising the
trim threshold stops glibc from handing the heap top back to the kernel after each step.

oneDNN and ideep (torch's wrapper around it) each keep the primitives they built, JIT code
included, in a cache of 1,024 entries by default, keyed by shape. A linear of a new row count
is a new entry in both (0.5-1 MiB together), so a worker prefilling prompts of every length
grows its heap until both caches are full (a soak on an AVX-512-BF16 CPU: +540 MiB in 5
minutes, still rising). ONEDNN_CACHE_CAPACITY bounds both; a miss costs one build, 0.6 ms
on Zen 4 and 3-5 ms on Sapphire Rapids, once per new row count and weight shape, not per
layer. bfloat16 activations round the row count oneDNN sees up to ~31 sizes
(`kernels.cpu_ops.onednn_rows`), whose builds all fit.

What decode streams from memory every step, the packed weights and the KV cache, lives in
mappings asked for 2 MiB pages (`huge_page_buffer`): with 4 KiB ones a core's reads cross a
page, and its TLB reach, every 64 lines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# CPU features with fast bfloat16 matmul in oneDNN (AMX tiles, or AVX-512 bf16 dot products).
BF16_MATMUL_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers up to this size come from the heap; the KV cache and weights above it stay mmapped.
_MMAP_THRESHOLD_BYTES = 256 * 2**20
_TRIM_THRESHOLD_BYTES = 1 * 2**30
# Entries in each of oneDNN's and ideep's primitive caches (0 crashes ideep): the distinct
# weight shapes of a layer (~7) for the last ~18 row counts. Read at their first use, so set
# before any linear runs; an operator's own setting of either variable stands.
ONEDNN_CACHE_CAPACITY = 128
_ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
HUGE_PAGE_BYTES = 2 * 2**20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return None if name is None else ctypes.CDLL(name)
    except OSError:
        return None


def release_free_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim; elsewhere nothing)
    after a one-off copy, which the trim threshold would otherwise keep resident: the packed
    weights gathered into 2 MiB pages left their first copies there (+260 MiB a process for
    the default model in bfloat16, +620 MiB in float32)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def tune_cpu_runtime() -> bool:
    """Bound oneDNN's caches and set glibc's malloc thresholds, once per process and before
    any linear runs; whether the malloc thresholds are set (False: glibc is not the allocator)."""
    for name in _ONEDNN_CACHE_ENV:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
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


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8, 2 MiB-aligned) of a fresh anonymous mapping whose pages the
    kernel is asked to make 2 MiB ones (MADV_HUGEPAGE: Linux, transparent huge pages in
    `madvise` or `always` mode) as they are first written; 4 KiB ones where it declines.
    Zen 5, one thread, against 4 KiB pages: 30 layers' linears and the LM head streamed from
    memory, one row -5 to -10% (bfloat16, int8, Q4_1), 8 rows of Q4_1 -8%; engine decode
    steps (weights and KV), one sequence -2% (bfloat16), -3% (int8), -6% (Q4_1), 8 -5 to -7%
    (bfloat16), 32 0 to -3%; a plain read of 1 GiB +4% GB/s."""
    # Whole 2 MiB pages: a mapping's part asked for them is eligible only where it holds one.
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    if length and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, length)
    return whole[offset : offset + nbytes]
