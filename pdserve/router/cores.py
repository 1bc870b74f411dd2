"""Which CPU cores each disaggregated worker is pinned to."""

from __future__ import annotations

from collections.abc import Sequence


def assign_cores(cores: Sequence[int], num_workers: int) -> list[tuple[int, ...]]:
    """Split `cores` among `num_workers` workers, in order (prefill workers come first).

    With at least one core per worker each gets a contiguous share and the first workers take
    the leftovers (2 cores, 2 workers: core 0 and core 1; 3 cores: (0, 1) and (2,)). With fewer
    cores than workers they share round robin, one core each.
    """
    if num_workers < 1:
        raise ValueError(f"need at least one worker, got {num_workers}")
    if not cores:
        raise ValueError("no CPU cores to pin workers to")
    cores = sorted(cores)
    if len(cores) < num_workers:
        return [(cores[i % len(cores)],) for i in range(num_workers)]
    share, extra = divmod(len(cores), num_workers)
    shares, start = [], 0
    for i in range(num_workers):
        size = share + (1 if i < extra else 0)
        shares.append(tuple(cores[start : start + size]))
        start += size
    return shares
