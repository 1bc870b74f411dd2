"""Equal resources: every launched mode runs on the same cores.

A comparison that hands one mode more cores than another is a verdict on the hardware, not
on the architecture. So `bench compare` and `bench demo` give every mode the same
`num_cores` (default: every core this process may run on): colocated and chunked as that many
replicas behind the router (`serve --data-parallel-size N`, one engine per core), disagg as
P prefill + D decode workers with P + D = N (one engine per core; the split given, or derived
from the workload's share of prefill work). On one core a mode runs its single server, and
disagg its two workers share the core. Each row records its layout; a row of another
server declares its cores (`--external NAME=URL@CORES`) or is shown but not ranked.
"""

from __future__ import annotations

import os

from pdserve.core.config import Mode
from pdserve.workload.errors import BenchError
from pdserve.workload.table import Layout


def machine_cores() -> list[int]:
    """The cores this process may run on (its affinity), in order."""
    return sorted(os.sched_getaffinity(0))


def resolve_cores(num_cores: int | None) -> tuple[int, ...]:
    """The first `num_cores` of this machine's cores (default: all of them)."""
    cores = machine_cores()
    if num_cores is None:
        return tuple(cores)
    if not 1 <= num_cores <= len(cores):
        raise BenchError(f"--cores must be in [1, {len(cores)}] on this machine, got {num_cores}")
    return tuple(cores[:num_cores])


def disagg_split(num_cores: int, prefill_share: float = 0.5) -> tuple[int, int]:
    """Prefill and decode workers for `num_cores` cores, one engine per core: the prefill
    pool's share of them as the workload's share of engine time spent in prefill, at least
    one worker in each pool (two workers sharing the core on one core)."""
    if num_cores < 2:
        return 1, 1
    num_prefill = min(num_cores - 1, max(1, round(num_cores * prefill_share)))
    return num_prefill, num_cores - num_prefill


def parse_split(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D), each at least 1."""
    prefill, sep, decode = text.partition(":")
    try:
        split = int(prefill), int(decode)
    except ValueError:
        split = (0, 0)
    if not sep or min(split) < 1:
        raise BenchError(f"--disagg-split: expected P:D with P, D >= 1, got {text!r}")
    return split


def mode_layout(mode: str, num_cores: int, split: tuple[int, int] | None = None) -> Layout:
    """The layout `mode` runs on `num_cores` cores (module doc)."""
    if mode == Mode.DISAGG.value:
        num_prefill, num_decode = split or disagg_split(num_cores)
        return Layout(
            num_prefill + num_decode,
            num_cores,
            f"{num_prefill} prefill + {num_decode} decode",
            ("--prefill-workers", str(num_prefill), "--decode-workers", str(num_decode)),
        )
    if num_cores == 1:
        return Layout(1, 1, f"1 {mode} engine")
    return Layout(
        num_cores,
        num_cores,
        f"{num_cores} {mode} replicas",
        ("--data-parallel-size", str(num_cores)),
    )


def parse_external(name: str, text: str) -> tuple[str, Layout]:
    """An --external value, URL or URL@CORES: the URL and the row's layout."""
    url, sep, cores = text.rpartition("@")
    if not sep or not cores.isdigit():
        return text, Layout(None, None, "external, cores not declared")
    num_cores = int(cores)
    if num_cores < 1 or not url:
        raise BenchError(f"--external {name}: expected URL@CORES with CORES >= 1, got {text!r}")
    return url, Layout(None, num_cores, f"external on {num_cores} cores")
