"""The router follows every worker's KV events (``GET /kv/events``, `server.kv_events`) into
its `PrefixIndex`.

One task per worker URL, over the router's fleet HTTP client (the fleet's authentication on
every request). The stream opens with a snapshot (or resumes after the last event applied when
the worker still has what followed it); every later event must carry the next sequence number:
a gap, a broken stream or a bad line drops the connection and the next one starts from a fresh
snapshot (a gap) or resumes (a broken stream: the worker replays or snapshots as it can). A
restarted worker is a new epoch, so it always answers a snapshot. Any number of routers
subscribe to the same workers and hold the same index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable

import httpx

from pdserve.router.prefix_index import PrefixIndex

logger = logging.getLogger("pdserve.router")

# Wait before reconnecting to a worker whose stream ended (it is restarting, or gone).
RECONNECT_S = 0.5


class EventGap(Exception):
    """An event's sequence number is not the next one: some were lost."""


class _Position:
    """Where a worker's stream is: its epoch and the last sequence number applied."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq: int | None = None

    def params(self) -> dict[str, str | int]:
        if self.epoch is None or self.seq is None:
            return {}
        return {"epoch": self.epoch, "seq": self.seq}


class KVEventSubscriber:
    def __init__(
        self, index: PrefixIndex, client: httpx.AsyncClient, connect_timeout_s: float
    ) -> None:
        self.index = index
        self.client = client
        self._timeout = httpx.Timeout(None, connect=connect_timeout_s)
        self._tasks: dict[str, asyncio.Task] = {}
        self._positions: dict[str, _Position] = {}
        self.num_snapshots = 0
        self.num_gaps = 0

    def sync(self, urls: Iterable[str]) -> None:
        """Follow exactly these workers: new ones from now, gone ones no more (forgotten)."""
        wanted = set(urls)
        for url in sorted(self._tasks.keys() - wanted):
            self._tasks.pop(url).cancel()
            self._positions.pop(url, None)
            self.index.forget(url)
        for url in sorted(wanted - self._tasks.keys()):
            self._positions[url] = _Position()
            self._tasks[url] = asyncio.create_task(self._follow(url))

    def is_synced(self, url: str) -> bool:
        """Whether a snapshot of the worker at `url` has been applied."""
        position = self._positions.get(url)
        return position is not None and position.seq is not None

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, url: str) -> None:
        position = self._positions[url]
        while True:
            try:
                await self._read_stream(url, position)
            except EventGap as exc:
                self.num_gaps += 1
                logger.warning("KV events of %s: %s; taking a snapshot", url, exc)
                position.seq = None
                continue
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                logger.debug("KV events of %s: %s", url, exc)
            await asyncio.sleep(RECONNECT_S)

    async def _read_stream(self, url: str, position: _Position) -> None:
        async with self.client.stream(
            "GET", f"{url}/kv/events", params=position.params(), timeout=self._timeout
        ) as response:
            if response.status_code != 200:
                raise httpx.HTTPStatusError(
                    f"/kv/events answered {response.status_code}",
                    request=response.request,
                    response=response,
                )
            async for line in response.aiter_lines():
                if line:
                    self.apply(url, position, json.loads(line))

    def apply(self, url: str, position: _Position, record: dict) -> None:
        """One line of the stream (raises EventGap, or ValueError for a malformed one)."""
        kind, seq, hashes = record["type"], int(record["seq"]), record["block_hashes"]
        if kind == "snapshot":
            self.index.replace(url, hashes)
            self.index.replace_store(url, record.get("store_block_hashes", ()))
            position.epoch, position.seq = str(record["epoch"]), seq
            self.num_snapshots += 1
            return
        if position.seq is None or seq != position.seq + 1:
            raise EventGap(f"event {seq} after {position.seq}")
        is_store = record.get("medium") == "store"
        if kind == "pending" and is_store:
            # Counted as in the store already: a worker that reads it waits for the write.
            self.index.add_store(url, hashes)
        elif kind == "stored":
            self.index.add_store(url, hashes) if is_store else self.index.add(url, hashes)
        elif kind == "removed":
            self.index.discard_store(hashes) if is_store else self.index.discard(url, hashes)
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
        position.seq = seq
