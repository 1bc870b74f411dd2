"""Compiling the kernels' C source into a shared library once per ISA variant, cached on disk.

A variant is a set of compiler flags and the CPU flags it needs: `amx` (`avx512_bf16` plus AMX
tiles, which prefill attention uses), `avx512_bf16` (AVX-512 with bfloat16 and int8 dot
products), `avx512`, `avx2` (with FMA and F16C) and `portable` (plain C
that GCC or Clang vectorise for any target, ARM included). `runnable_variants()` lists those
this CPU can run, best first.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.model.cpu_runtime import read_cpu_flags

logger = logging.getLogger(__name__)

# Never -ffast-math: linking with it sets flush-to-zero for the whole process at load time,
# which changes every other float computation in it (numpy, hypothesis and torch saw it).
# No -march=native: each variant names its instruction set, so the portable build stays
# portable and one cached library per variant serves any CPU that has its flags.
CFLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread")
# Generous: on a loaded 2-vCPU VM one variant took 4 minutes of wall time (20 s of CPU).
COMPILE_TIMEOUT_S = 600
# Builds (and measured choices) kept per source and variant: each edit of the source makes a
# new build, so without a bound the cache grows by one library per edit and variant. A few
# are kept so that checkouts used side by side (worktrees, a release beside main) do not
# rebuild each other's away.
NUM_KEPT_BUILDS = 4
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c")
_X86 = ("x86_64", "amd64")


@dataclass(frozen=True)
class IsaVariant:
    name: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the CPU needs
    cflags: tuple[str, ...]
    machines: tuple[str, ...] | None  # platform.machine() values; None: any


_AVX512_BF16_CFLAGS = (
    "-DPDSERVE_ISA_AVX512",
    *(f"-m{f}" for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2")),
    *("-mfma", "-mf16c", "-mavx512bf16", "-mavx512vnni"),
)
VARIANTS = (
    IsaVariant(
        "amx",
        frozenset(
            (
                *_AVX512,
                "avx512_bf16",
                "avx512_vnni",
                "avx512vbmi",
                "amx_tile",
                "amx_bf16",
                "amx_int8",
            )
        ),
        (*_AVX512_BF16_CFLAGS, "-mavx512vbmi", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
        _X86,
    ),
    IsaVariant(
        "avx512_bf16",
        frozenset((*_AVX512, "avx512_bf16", "avx512_vnni")),
        _AVX512_BF16_CFLAGS,
        _X86,
    ),
    IsaVariant(
        "avx512",
        frozenset(_AVX512),
        (
            "-DPDSERVE_ISA_AVX512",
            *(f"-m{f}" for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2")),
            *("-mfma", "-mf16c"),
        ),
        _X86,
    ),
    IsaVariant(
        "avx2",
        frozenset(("avx2", "fma", "f16c")),
        ("-DPDSERVE_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"),
        _X86,
    ),
    IsaVariant("portable", frozenset(), (), None),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variant(name: str) -> IsaVariant:
    for candidate in VARIANTS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown CPU kernel variant {name!r} (known: {', '.join(VARIANT_NAMES)})")


def can_run(candidate: IsaVariant, cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with `cpu_flags`) executes the variant's instructions."""
    if candidate.machines is not None and platform.machine().lower() not in candidate.machines:
        return False
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    return candidate.cpu_flags <= flags


def runnable_variants(cpu_flags: frozenset[str] | None = None) -> tuple[IsaVariant, ...]:
    """The variants this CPU can run, best first (portable always)."""
    return tuple(v for v in VARIANTS if can_run(v, cpu_flags))


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load_library(source: Path, isa: IsaVariant = VARIANTS[-1]) -> ctypes.CDLL | None:
    """`source` compiled for `isa`, built if needed; None (with a warning) if it cannot be.
    Headers next to the source are part of the cache key."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning(
            "no C compiler found; using the slower torch path instead of %s", source.name
        )
        return None
    headers = sorted(source.parent.glob("*.h"))
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(h.read_bytes() for h in headers),
                " ".join((*CFLAGS, *isa.cflags)).encode(),
                compiler.encode(),
            ]
        )
    ).hexdigest()[:16]
    try:
        library = cache_dir() / f"{source.stem}-{isa.name}-{key}.so"
    except OSError as e:
        logger.warning("%s; using the slower torch path instead of %s", e, source.name)
        return None
    if not (mark_used(library) or _compile(compiler, source, isa, library)):
        return None
    prune_older(library)
    try:
        return ctypes.CDLL(str(library))
    except OSError as e:
        logger.warning("cannot load %s (%s); using the slower torch path", library, e)
        return None


def _compile(compiler: str, source: Path, isa: IsaVariant, library: Path) -> bool:
    # Build under a private name and rename: concurrent workers never see a partial file.
    fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
    os.close(fd)
    command = [compiler, *CFLAGS, *isa.cflags, f"-I{source.parent}", str(source)]
    command += ["-o", partial, "-lm"]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(partial, library)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        stderr = getattr(e, "stderr", b"") or b""
        logger.warning(
            "compiling %s for %s failed (%s %s); using the slower torch path",
            source.name,
            isa.name,
            e,
            stderr.decode(errors="replace")[-500:],
        )
        return False
    finally:
        Path(partial).unlink(missing_ok=True)


def mark_used(path: Path) -> bool:
    """Record a use of the cached `path` in its mtime (what `prune_older` keeps by); whether
    it exists."""
    try:
        os.utime(path)
        return True
    except OSError:
        return False


def prune_older(path: Path, num_kept: int = NUM_KEPT_BUILDS) -> None:
    """Remove the cached siblings of `path` (same name up to its 16-hex-digit key), all but
    the `num_kept` used last, `path` among them. A process that loaded a removed library
    keeps its mapping; one about to load it marks it used first, which makes it the newest."""
    stem = path.name.rpartition("-")[0]
    pattern = re.compile(rf"{re.escape(stem)}-[0-9a-f]{{16}}{re.escape(path.suffix)}")

    def last_used(sibling: Path) -> float:
        try:
            return sibling.stat().st_mtime
        except OSError:  # removed meanwhile by another process
            return 0.0

    try:
        siblings = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and p != path]
    except OSError:
        return
    for sibling in sorted(siblings, key=last_used, reverse=True)[num_kept - 1 :]:
        sibling.unlink(missing_ok=True)


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for candidate in (
        base / "pdserve" / "kernels",
        Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}",
    ):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no writable cache directory for compiled kernels")
