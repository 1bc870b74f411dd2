"""Compiling a C source into a shared library once per machine, cached on disk."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.model.cpu_runtime import read_cpu_flags

logger = logging.getLogger(__name__)

# -march=native ties the library to this CPU, hence the CPU flags in the cache key. Never
# -ffast-math: linking with it sets flush-to-zero for the whole process at load time, which
# changes every other float computation in it (numpy, hypothesis and torch saw it).
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-fPIC", "-shared")
COMPILE_TIMEOUT_S = 120


def load_library(source: Path) -> ctypes.CDLL | None:
    """The compiled `source`, built if needed; None (with a warning) if it cannot be."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning(
            "no C compiler found; using the slower torch path instead of %s", source.name
        )
        return None
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                " ".join(CFLAGS).encode(),
                compiler.encode(),
                " ".join(sorted(read_cpu_flags())).encode(),
            ]
        )
    ).hexdigest()[:16]
    try:
        library = _cache_dir() / f"{source.stem}-{key}.so"
    except OSError as e:
        logger.warning("%s; using the slower torch path instead of %s", e, source.name)
        return None
    if not library.is_file() and not _compile(compiler, source, library):
        return None
    try:
        return ctypes.CDLL(str(library))
    except OSError as e:
        logger.warning("cannot load %s (%s); using the slower torch path", library, e)
        return None


def _compile(compiler: str, source: Path, library: Path) -> bool:
    # Build under a private name and rename: concurrent workers never see a partial file.
    fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
    os.close(fd)
    command = [compiler, *CFLAGS, str(source), "-o", partial, "-lm"]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(partial, library)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        stderr = getattr(e, "stderr", b"") or b""
        logger.warning(
            "compiling %s failed (%s %s); using the slower torch path",
            source.name,
            e,
            stderr.decode(errors="replace")[-500:],
        )
        return False
    finally:
        Path(partial).unlink(missing_ok=True)


def _cache_dir() -> Path:
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
