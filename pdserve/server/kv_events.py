"""The worker's KV events over HTTP, for routers (`pdserve.router.kv_events` subscribes).

``GET /kv/events`` streams newline-delimited JSON: first a snapshot (``{"type": "snapshot",
"epoch", "seq", "block_hashes"}``), unless ``?epoch=E&seq=N`` names a point this process can
resume from (then only the events after it), then every event as it happens (``{"type":
"stored" | "removed" | "pending", "seq", "block_hashes"}``, with ``"medium": "store"`` for
what the worker learned of the shared KV store; ``pending`` is a store write queued). A
subscriber that falls so far behind that the log dropped events it has not read gets a fresh
snapshot in the stream. A role switch
sends every subscriber a snapshot too (a clean point to re-check against). Guarded like every
other fleet path (`api.asgi`: the fleet secret, or the API key).

``GET /kv/blocks`` is the debug view tests compare routers against: the hashes in the block
manager's own prefix cache, read from it (not from the event log).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Query
from fastapi.responses import StreamingResponse

from pdserve.core.kv_events import KVEventLog

MEDIA_TYPE = "application/x-ndjson"


def _line(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


class KVEventStreams:
    """The worker's event log and its subscribers' wake-ups."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        # Per subscriber: set to send a snapshot next (a role switch asked for one).
        self._resync: set[asyncio.Event] = set()
        self._subscribers: set[asyncio.Event] = set()

    def resync_all(self) -> None:
        """Every subscriber gets a snapshot next (call on the event loop)."""
        self._resync.update(self._subscribers)
        for wake in self._subscribers:
            wake.set()

    async def stream(self, epoch: str | None, seq: int | None) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:  # on the engine thread
            loop.call_soon_threadsafe(wake.set)

        self._subscribers.add(wake)
        self.log.add_listener(notify)
        try:
            position = None if epoch is None or seq is None else (epoch, seq)
            while True:
                events = None
                if position is not None and wake not in self._resync:
                    events = self.log.events_after(*position)
                self._resync.discard(wake)
                if events is None:
                    snapshot = self.log.snapshot()
                    position = (snapshot.epoch, snapshot.seq)
                    yield _line(snapshot.to_dict())
                elif events:
                    position = (position[0], events[-1].seq)
                    yield b"".join(_line(event.to_dict()) for event in events)
                wake.clear()
                if self.log.seq == position[1] and wake not in self._resync:
                    await wake.wait()
        finally:
            self.log.remove_listener(notify)
            self._subscribers.discard(wake)
            self._resync.discard(wake)


def add_kv_event_routes(app: FastAPI, streams: KVEventStreams, cached_block_hashes) -> None:
    @app.get("/kv/events", response_model=None)
    async def kv_events(epoch: str | None = None, seq: int | None = Query(None, ge=0)):
        """This worker's KV events as NDJSON (see `pdserve.server.kv_events`)."""
        return StreamingResponse(streams.stream(epoch, seq), media_type=MEDIA_TYPE)

    @app.get("/kv/blocks", response_model=None)
    async def kv_blocks() -> dict:
        """The block hashes in this worker's prefix cache, from its block manager."""
        return {"epoch": streams.log.epoch, "block_hashes": sorted(cached_block_hashes())}
