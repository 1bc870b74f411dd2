"""Choices between two implementations of one op, measured on the machine that runs them.

Which of two kernels is faster depends on the CPU (its ISA, cache sizes, whether torch's
kernels use AMX), the dtypes, the thread count and the sizes, so a table measured elsewhere
goes stale. A `MeasuredChoice` times both candidates on a synthetic input of a case's size
bucket, keeps the winner, and caches the timings on disk next to the compiled kernels, keyed
by the library build, the CPU model and torch's version: later processes on the machine read
the answer instead of measuring again.

Measuring takes up to seconds, so a serving path never measures: the engine measures the
cases its limits allow at startup (`measure`, cheapest first, within a time budget), and a
case met unmeasured takes the caller's default. Cases the budget left out stay at the default
in that process (`skipped`): measured while idle, a multi-second case would delay the request
that arrives meanwhile (a colocated engine's 8k-token prompts). The cache is on disk, so the
next start goes on from where this one stopped. A case outside the startup grid waits in a
queue and the engine measures it while it is idle (`measure_pending`). Until then, where the
choice says which of a case's fields are sizes, an unmeasured case takes the answer of the
measured case nearest in size with the same other fields (a new build's first 3,000-token
prompt: 2,048 tokens' answer), and the caller's default only where none is measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from pdserve.model.cpu_runtime import read_cpu_flags
from pdserve.model.kernels.build import cache_dir, mark_used, prune_older

logger = logging.getLogger(__name__)

# Timed rounds after a warm-up one; each round runs A then B, so a burst of load from other
# processes hits both, and each candidate's best round counts.
ROUNDS = 5


def size_bucket(n: int, smallest: int = 16) -> int:
    """n rounded up to a power of two (at least `smallest`; 0 stays 0): cases within a
    factor of two share one measurement."""
    if n <= 0:
        return 0
    bucket = smallest
    while bucket < n:
        bucket *= 2
    return bucket


def interleaved_best_seconds(
    a: Callable[[], object], b: Callable[[], object], rounds: int = ROUNDS
) -> tuple[float, float]:
    """(best seconds of a, best of b) over `rounds` rounds of a then b, after one warm-up."""
    best = [float("inf"), float("inf")]
    a(), b()
    for _ in range(rounds):
        for i, run in enumerate((a, b)):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def kernels_cache_dir() -> Path | None:
    """Where choices are cached: beside the compiled kernels (a new build measures anew);
    None where that directory cannot be made (a choice is then measured in every process)."""
    try:
        return cache_dir()
    except OSError:
        return None


class MeasuredChoice:
    """Whether candidate A beats candidate B per case, timed on this machine and cached.

    `prepare(case) -> (run_a, run_b)` makes both runnable on an input of the case's size
    (a case is a tuple of JSON scalars, dtypes as names); they are timed interleaved. The last
    `num_size_fields` fields of a case are sizes (non-negative integers): see `a_wins_or`."""

    def __init__(
        self,
        name: str,
        build_id: str,
        prepare: Callable[[tuple], tuple[Callable[[], object], Callable[[], object]]],
        cache_dir: Path | None,
        num_size_fields: int = 0,
    ) -> None:
        self.name = name
        self.num_size_fields = num_size_fields
        self._prepare = prepare
        self._lock = threading.Lock()
        self._path = (
            None if cache_dir is None else cache_dir / f"{name}-{_machine_key(build_id)}.json"
        )
        self.timings: dict[str, tuple[float, float]] = self._read()
        # Cases met unmeasured by `a_wins_or`, by key, in arrival order.
        self.pending: dict[str, tuple] = {}
        # Keys `measure` had no budget left for: answered as unmeasured, never measured while
        # serving.
        self.skipped: set[str] = set()
        self.num_defaulted = 0  # how often `a_wins_or` answered with its default
        self.num_borrowed = 0  # how often it answered with the nearest measured case's
        self._nearest: dict[str, str | None] = {}  # `nearest_measured` by key, until a measure

    def a_wins(self, case: tuple[Hashable, ...]) -> bool:
        """Whether A is faster on `case`, measured now if it never was (blocks for it)."""
        a_seconds, b_seconds = self.timing(case)
        return a_seconds < b_seconds

    def a_wins_or(self, case: tuple[Hashable, ...], default: bool) -> bool:
        """Whether A is faster on `case` as measured; never measures nor waits for a
        measurement: a case not measured yet answers as the nearest measured case
        (`nearest_measured`), else `default`, and unless `measure` skipped it, is queued for
        `measure_pending`."""
        key = json.dumps(case)
        timing = self.timings.get(key)
        if timing is not None:
            return timing[0] < timing[1]
        if key not in self.skipped:
            self.pending.setdefault(key, case)  # one dict operation: thread-safe
        try:  # a chunk asks once per layer: search once per case
            nearest = self._nearest[key]
        except KeyError:
            nearest = self._nearest[key] = self.nearest_measured(case)
        if nearest is None:
            self.num_defaulted += 1
            return default
        self.num_borrowed += 1
        a_seconds, b_seconds = self.timings[nearest]
        return a_seconds < b_seconds

    def nearest_measured(self, case: tuple[Hashable, ...]) -> str | None:
        """The key of the measured case with `case`'s fields but its sizes, nearest in sizes
        (the sum of their log2 ratios); None without size fields or such a case."""
        if not self.num_size_fields:
            return None
        split = len(case) - self.num_size_fields
        fields, sizes = list(case[:split]), case[split:]
        best, best_distance = None, math.inf
        for key in list(self.timings):  # a copy: another thread may add a measurement
            other = json.loads(key)
            if len(other) != len(case) or other[:split] != fields:
                continue
            pairs = zip(sizes, other[split:], strict=True)
            distance = sum(abs(math.log2((1 + a) / (1 + b))) for a, b in pairs)
            if distance < best_distance:
                best, best_distance = key, distance
        return best

    def timing(self, case: tuple[Hashable, ...]) -> tuple[float, float]:
        """(A's, B's) best seconds on `case`: from the cache, else measured now."""
        key = json.dumps(case)
        timing = self.timings.get(key)
        if timing is None:
            with self._lock:
                timing = self.timings.get(key)
                if timing is None:
                    timing = self._measure(key, case)
                    self._write()
        return timing

    def measure(self, cases: Sequence[tuple], budget_s: float) -> int:
        """Measure the `cases` not measured yet, in order (cheapest first, so that the case
        just timed bounds what the next costs), while the next one should end within
        `budget_s`; mark the rest `skipped`. Returns how many it timed."""
        start = time.perf_counter()
        last_case_s = 0.0
        num_measured = 0
        with self._lock:
            for case in cases:
                key = json.dumps(case)
                if key in self.timings:
                    continue
                case_start = time.perf_counter()
                if case_start - start + last_case_s > budget_s:
                    self.skipped.add(key)
                    continue
                self._measure(key, case)
                last_case_s = time.perf_counter() - case_start
                num_measured += 1
            if num_measured:
                self._write()
        return num_measured

    def measure_pending(self) -> bool:
        """Measure the oldest queued case, if any (for idle time); whether one was."""
        try:
            key = next(iter(self.pending))
        except (StopIteration, RuntimeError):  # empty, or changed meanwhile: next time
            return False
        case = self.pending[key]
        with self._lock:
            if key not in self.timings:
                a_seconds, b_seconds = self._measure(key, case)
                self._write()
                logger.info(
                    "%s %s measured while idle: %.3f ms vs %.3f ms",
                    self.name,
                    key,
                    a_seconds * 1e3,
                    b_seconds * 1e3,
                )
            self.pending.pop(key, None)  # measured meanwhile by someone else: just drop it
        return True

    def _measure(self, key: str, case: tuple) -> tuple[float, float]:
        """Time `case` now and keep it (the caller holds the lock and writes the cache)."""
        timing = interleaved_best_seconds(*self._prepare(case))
        self.timings[key] = timing
        self._nearest = {}  # a nearer case may be measured now
        self.pending.pop(key, None)
        self.skipped.discard(key)
        logger.debug(
            "%s %s: %.3f ms vs %.3f ms (measured here, cached in %s)",
            self.name,
            key,
            timing[0] * 1e3,
            timing[1] * 1e3,
            self._path,
        )
        return timing

    def _read(self) -> dict[str, tuple[float, float]]:
        if self._path is None:
            return {}
        try:
            data = json.loads(self._path.read_text())
            mark_used(self._path)
            return {key: (float(a), float(b)) for key, (a, b) in data.items()}
        except (OSError, ValueError, TypeError):
            return {}

    def _write(self) -> None:
        if self._path is None:
            return
        # Merge with what another process wrote meanwhile; write under a private name and
        # rename, so a reader never sees half a file.
        merged = self._read() | self.timings
        try:
            fd, partial = tempfile.mkstemp(dir=self._path.parent, suffix=".json.partial")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(partial, self._path)
            prune_older(self._path)
        except OSError as e:
            logger.warning("cannot cache %s's timings in %s: %s", self.name, self._path, e)


def _machine_key(build_id: str) -> str:
    """What the timings depend on besides the case: the kernels' build, the CPU, torch."""
    parts = (build_id, _cpu_model(), " ".join(sorted(read_cpu_flags())), torch.__version__)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return ""
