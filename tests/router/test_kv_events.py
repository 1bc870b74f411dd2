"""The KV-event wire: a worker's `KVEventStreams` over HTTP, the router's `KVEventSubscriber`."""

import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.api.asgi import install_front_door
from pdserve.api.signing import FleetAuth
from pdserve.core.kv_events import KVEventLog
from pdserve.router.kv_events import KVEventSubscriber
from pdserve.router.prefix_index import PrefixIndex
from pdserve.server.kv_events import KVEventStreams, add_kv_event_routes
from tests.router.harness import AppThread

SECRET = "fleet-secret-for-tests"


def _worker_app(streams: KVEventStreams, cached) -> FastAPI:
    app = FastAPI()
    install_front_door(
        app, api_key=None, protected_prefixes=(), max_body_bytes=1 << 20, fleet_secret=SECRET
    )
    add_kv_event_routes(app, streams, cached)

    @app.post("/resync")  # what a role switch does
    async def resync() -> dict:
        streams.resync_all()
        return {}

    return app


async def _until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_the_router_index_follows_the_log_through_overflow_and_resync_with_the_secret():
    log = KVEventLog(max_events=8)
    streams = KVEventStreams(log)
    log.blocks_stored([1, 2, 3])  # before anyone subscribes: arrives in the snapshot
    with AppThread(_worker_app(streams, lambda: list(log.snapshot().block_hashes))) as worker:

        async def run() -> None:
            index = PrefixIndex(4)
            async with httpx.AsyncClient(trust_env=False) as stranger:
                refused = await stranger.get(f"{worker.url}/kv/events")
                assert refused.status_code == 401
            async with httpx.AsyncClient(auth=FleetAuth(SECRET), trust_env=False) as client:
                subscriber = KVEventSubscriber(index, client, connect_timeout_s=5.0)
                subscriber.sync([worker.url])
                await _until(lambda: subscriber.is_synced(worker.url), "the first snapshot")
                assert index.num_blocks(worker.url) == 3
                # Far more events than the log keeps, from another thread, as an engine would.
                await asyncio.to_thread(
                    lambda: [
                        log.blocks_removed([h - 2]) if h % 3 == 0 else log.blocks_stored([h])
                        for h in range(4, 400)
                    ]
                )
                expected = set(log.snapshot().block_hashes)
                await _until(lambda: index._blocks.get(worker.url) == expected, "the index")
                assert subscriber.num_gaps == 0
                num_snapshots = subscriber.num_snapshots
                assert (await client.post(f"{worker.url}/resync")).status_code == 200
                await _until(lambda: subscriber.num_snapshots == num_snapshots + 1, "a resync")
                await asyncio.to_thread(lambda: log.blocks_stored([10_000]))
                await _until(lambda: 10_000 in index._blocks[worker.url], "the next event")
                subscriber.sync([])
                assert index.num_blocks(worker.url) == 0
                await subscriber.stop()

        asyncio.run(run())


def test_a_lost_event_makes_the_router_take_a_fresh_snapshot():
    app = FastAPI()
    connections: list[dict] = []
    scripts = [
        # The first stream loses event 2.
        [
            {"type": "snapshot", "epoch": "e", "seq": 0, "block_hashes": [1]},
            {"type": "stored", "seq": 1, "block_hashes": [2]},
            {"type": "stored", "seq": 3, "block_hashes": [4]},
        ],
        [{"type": "snapshot", "epoch": "e", "seq": 3, "block_hashes": [1, 2, 3, 4]}],
    ]

    @app.get("/kv/events")
    async def events(request: Request):
        connections.append(dict(request.query_params))
        script = scripts[min(len(connections), len(scripts)) - 1]

        async def body():
            for record in script:
                yield json.dumps(record).encode() + b"\n"
            await asyncio.sleep(3600)

        return StreamingResponse(body(), media_type="application/x-ndjson")

    with AppThread(app) as worker:

        async def run() -> None:
            index = PrefixIndex(4)
            async with httpx.AsyncClient(trust_env=False) as client:
                subscriber = KVEventSubscriber(index, client, connect_timeout_s=5.0)
                subscriber.sync([worker.url])
                await _until(lambda: len(connections) == 2, "a second connection")
                await _until(lambda: index.num_blocks(worker.url) == 4, "the snapshot")
                await subscriber.stop()
            assert index._blocks[worker.url] == {1, 2, 3, 4}
            assert subscriber.num_gaps == 1
            assert connections[1] == {}  # no resume point: a snapshot, not a replay

        asyncio.run(run())


def test_a_store_write_in_flight_counts_on_every_worker_until_it_fails():
    from pdserve.router.kv_events import _Position

    log = KVEventLog()
    store = log.store_observer()
    store.blocks_pending([1, 2])  # queued for the store: a reader will wait for them
    assert set(log.snapshot().store_block_hashes) == {1, 2}
    index = PrefixIndex(4, shared_store=True)
    subscriber = KVEventSubscriber(index, client=None, connect_timeout_s=1.0)
    position = _Position()
    subscriber.apply("http://a", position, log.snapshot().to_dict())
    store.blocks_pending([3])
    (event,) = log.events_after(log.epoch, position.seq)
    assert event.to_dict()["type"] == "pending" and event.to_dict()["medium"] == "store"
    subscriber.apply("http://a", position, event.to_dict())
    assert index.num_cached_tokens("http://b", [1, 2, 3], 100) == 12
    store.blocks_removed([3])  # its write failed
    (event,) = log.events_after(log.epoch, position.seq)
    subscriber.apply("http://a", position, event.to_dict())
    assert index.num_cached_tokens("http://b", [1, 2, 3], 100) == 8
