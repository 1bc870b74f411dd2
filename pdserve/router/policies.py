"""Which worker of a pool takes a request: round robin, least loaded, prefix aware.

Pure Python (no I/O, no clocks) so the cluster simulator runs the same ones (`sim/router.py`).
A policy sees one `WorkerLoad` per candidate worker, in a stable order, and returns an index.
Each is registered by the name `--prefill-policy` / `--decode-policy` take (`POLICIES`; the
flags' choices and `RouterConfig`'s check read it).

Load means different things per pool (`PoolRole`):
- prefill: prompt tokens the router has sent and not yet seen answered (what a prefill worker
  still has to compute);
- decode: running plus waiting sequences, then KV-cache usage as the tie-break.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class PoolRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerLoad:
    """What the router knows about one candidate worker when a request arrives."""

    num_running: int = 0
    num_waiting: int = 0
    # Prompt tokens of prefill legs in flight on this worker.
    num_pending_prefill_tokens: int = 0
    kv_cache_usage: float = 0.0
    # Tokens of *this* request's prompt the worker's KV events say it has cached.
    num_cached_tokens: int = 0


class RoutingPolicy(Protocol):
    def select(self, loads: Sequence[WorkerLoad], prompt_len: int) -> int:
        """Index into `loads` of the worker that takes a request of `prompt_len` tokens."""
        ...


def load_of(load: WorkerLoad, role: PoolRole) -> int:
    """The scalar a pool balances: pending prefill tokens, or sequences on a decode worker."""
    if role is PoolRole.PREFILL:
        return load.num_pending_prefill_tokens
    return load.num_running + load.num_waiting


def _least_loaded_index(loads: Sequence[WorkerLoad], role: PoolRole, indices: Sequence[int]) -> int:
    # Ties go to the emptier KV cache, then to the lowest index (deterministic).
    return min(indices, key=lambda i: (load_of(loads[i], role), loads[i].kv_cache_usage, i))


class RoundRobin:
    """Each request to the next worker in order."""

    def __init__(self, role: PoolRole) -> None:
        self.role = role
        self._next = 0

    def select(self, loads: Sequence[WorkerLoad], prompt_len: int) -> int:
        _check_nonempty(loads)
        index = self._next % len(loads)
        self._next += 1
        return index


class LeastLoaded:
    """The worker with the smallest `load_of` for this pool's role."""

    def __init__(self, role: PoolRole) -> None:
        self.role = role

    def select(self, loads: Sequence[WorkerLoad], prompt_len: int) -> int:
        _check_nonempty(loads)
        return _least_loaded_index(loads, self.role, range(len(loads)))


class PrefixAware:
    """The worker with the longest cached prefix of the prompt, unless it is overloaded.

    Overloaded means ``load(best) + unit > balance_factor * (load(least) + unit)``, where the
    unit is one request's worth of load (one sequence for decode, this prompt's tokens for
    prefill) so that an idle pool does not look infinitely imbalanced. With no cached prefix
    anywhere, or when overloaded, it falls back to least loaded.
    """

    def __init__(self, role: PoolRole, balance_factor: float = 2.0) -> None:
        if balance_factor < 1.0:
            raise ValueError(f"balance_factor must be >= 1.0, got {balance_factor}")
        self.role = role
        self.balance_factor = balance_factor

    def select(self, loads: Sequence[WorkerLoad], prompt_len: int) -> int:
        _check_nonempty(loads)
        everyone = range(len(loads))
        least = _least_loaded_index(loads, self.role, everyone)
        longest = max(load.num_cached_tokens for load in loads)
        if longest == 0:
            return least
        matches = [i for i in everyone if loads[i].num_cached_tokens == longest]
        best = _least_loaded_index(loads, self.role, matches)
        unit = max(prompt_len, 1) if self.role is PoolRole.PREFILL else 1
        best_load = load_of(loads[best], self.role) + unit
        least_load = load_of(loads[least], self.role) + unit
        return least if best_load > self.balance_factor * least_load else best


# A policy's builder: (its pool's role, the router's balance factor) -> the policy.
PolicyFactory = Callable[[PoolRole, float], RoutingPolicy]
# Every policy by its command-line name, in help order.
POLICIES: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make `factory`'s policy the one `--prefill-policy NAME` / `--decode-policy NAME` pick."""
    if name in POLICIES:
        raise ValueError(f"routing policy {name!r} is registered already")
    POLICIES[name] = factory


register_policy("round_robin", lambda role, balance_factor: RoundRobin(role))
register_policy("least_loaded", lambda role, balance_factor: LeastLoaded(role))
register_policy("prefix_aware", PrefixAware)


def make_policy(name: str, role: PoolRole, balance_factor: float = 2.0) -> RoutingPolicy:
    """Build a policy by its CLI name; raises ValueError naming the known ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](role, balance_factor)


def _check_nonempty(loads: Sequence[WorkerLoad]) -> None:
    if not loads:
        raise ValueError("no candidate workers to select from")
