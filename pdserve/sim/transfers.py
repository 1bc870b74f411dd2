"""KV transfers in flight over shared links: fair sharing of each node's bandwidth.

Each transfer crosses a set of `Channel`s (a node's egress and the peer's ingress, or one
node's intra-node fabric) and is capped by the lanes its endpoints drive. Active transfers
on a channel split its capacity equally; a transfer moves at the smallest share among its
channels (or its cap). Rates are recomputed whenever a transfer starts or ends, so the
completion times stay exact between those events (a processor-sharing model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A transfer within a nanosecond of done counts as done: completion times are absolute
# clock readings, and near the end the remaining time can drop below their resolution.
_DONE_WITHIN_S = 1e-9


@dataclass(eq=False)
class Channel:
    """A shared resource with `capacity` bytes/s."""

    name: str
    capacity: float
    num_active: int = 0


@dataclass(eq=False)
class Transfer:
    """One KV transfer; `payload` is whatever the caller needs back on completion."""

    num_bytes: float
    channels: tuple[Channel, ...]
    cap: float
    payload: object
    remaining: float = field(init=False)
    rate: float = 0.0

    def __post_init__(self) -> None:
        self.remaining = self.num_bytes


class TransferNetwork:
    """The set of in-flight transfers; the simulator advances it to each event's time."""

    def __init__(self) -> None:
        self.active: list[Transfer] = []
        self.now = 0.0

    def start(self, now: float, transfer: Transfer) -> None:
        self.advance(now)
        self.active.append(transfer)
        for channel in transfer.channels:
            channel.num_active += 1
        self._update_rates()

    def advance(self, now: float) -> list[Transfer]:
        """Move bytes up to `now`; return (and drop) the transfers that completed."""
        elapsed = now - self.now
        self.now = now
        for transfer in self.active:
            transfer.remaining -= transfer.rate * elapsed
        done = [t for t in self.active if t.remaining <= t.rate * _DONE_WITHIN_S]
        if done:
            self.active = [t for t in self.active if t not in done]
            for transfer in done:
                for channel in transfer.channels:
                    channel.num_active -= 1
            self._update_rates()
        return done

    def next_completion_time(self) -> float | None:
        if not self.active:
            return None
        return self.now + min(t.remaining / t.rate for t in self.active)

    def _update_rates(self) -> None:
        for transfer in self.active:
            shares = (c.capacity / c.num_active for c in transfer.channels)
            transfer.rate = min(transfer.cap, *shares)
