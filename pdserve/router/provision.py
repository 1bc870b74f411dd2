"""Where a deployment's workers come from: the interface the router calls, which every
launcher implements.

The router owns it (its `/workers` API, discovery and autoscaler use only this interface, so
they work the same on one host and on a fleet); the one-host launcher (`launch.local`, child
processes pinned to cores) and a cluster placement (`launch.ray_cluster`, Ray actors on
several nodes) implement it, so the router never imports the deployment layer.

Invariants: `start_worker` returns only once the worker answers ``GET /health`` (or raises
`WorkerStartupError`); `stop_worker` is called only after the router stopped routing to the
worker and its in-flight requests finished (drained), so stopping loses no request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WorkerHandle:
    """A running worker as its provisioner knows it."""

    name: str  # unique in the deployment: "prefill-0", "decode-3", ...
    role: str  # "prefill" or "decode"
    url: str  # where the router reaches its HTTP API
    # Where it runs, for `GET /workers` (a Ray node id, or None on a single host).
    node_id: str | None = None


class Provisioner(Protocol):
    def start_worker(self, role: str) -> WorkerHandle:
        """Start one worker of `role`; returns once it is healthy."""
        ...

    def stop_worker(self, name: str) -> None:
        """Stop a drained worker and release what it held (cores, a Ray actor)."""
        ...

    def workers(self) -> list[WorkerHandle]:
        """The workers running now (ones that died are gone from the list)."""
        ...

    def can_start(self, role: str) -> bool:
        """Whether there is room (cores, cluster resources) for one more worker of `role`."""
        ...
