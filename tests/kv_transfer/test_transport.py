"""Transport behaviour in one process (the two-process tests cover the real boundary):
producer-side validation, abort release, shutdown, reconnects, background receive, and the
shm lease re-check."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import select
import subprocess
import sys
import time

import pytest
import torch

from pdserve.kv_transfer import (
    KVLeaseError,
    KVProtocolError,
    KVTransferConfig,
    KVTransferError,
    LeaseManager,
    plan_units,
)
from pdserve.kv_transfer import shm as shm_module
from pdserve.kv_transfer import transport as transport_module
from pdserve.kv_transfer.connector import BackgroundReceiver, create_kv_transport
from pdserve.kv_transfer.shm import SHM_DIR, SharedKVCache, ShmTransport, remove_stale_segments
from tests.kv_transfer.helpers import NUM_BLOCKS, bits, reference_cache, tiny_layout

LAYOUT = tiny_layout("bfloat16")


class Pair:
    """A producer and a consumer transport in this process."""

    def __init__(self, transport: str, **producer_config) -> None:
        producer = KVTransferConfig(transport=transport, kv_role="kv_producer", **producer_config)
        self.producer = create_kv_transport(producer, LAYOUT, NUM_BLOCKS)
        self.producer.kv_cache.copy_(reference_cache(LAYOUT))
        consumer = KVTransferConfig(transport=transport, kv_role="kv_consumer")
        self.consumer = create_kv_transport(consumer, LAYOUT, NUM_BLOCKS)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


@pytest.fixture(params=["shm", "tcp"])
def pair(request):
    pair = Pair(request.param)
    yield pair
    pair.close()


def test_expose_validates_blocks_against_tokens(pair):
    with pytest.raises(KVProtocolError, match="9 tokens need 3 blocks"):
        pair.producer.expose("r", [1, 2], 9)
    with pytest.raises(KVProtocolError, match=r"block_ids\[\] must be in"):
        pair.producer.expose("r", [NUM_BLOCKS], 1)
    with pytest.raises(KVTransferError, match="not a kv_producer"):
        pair.consumer.expose("r", [1], 1)
    assert pair.producer.leases.num_held_blocks == 0


def test_abort_before_fetch_releases_the_lease(pair):
    params = pair.producer.expose("aborted", [4, 5], 8)
    assert pair.consumer.release(params) is True
    assert pair.producer.leases.num_held_blocks == 2  # until the engine collects it
    assert pair.producer.collect() == ["aborted"]
    assert pair.producer.leases.num_held_blocks == 0


def test_release_for_another_engine_incarnation_is_refused(pair):
    params = pair.producer.expose("mine", [4], 1)
    with pytest.raises(KVLeaseError, match="names engine restarted"):
        pair.consumer.release(dataclasses.replace(params, remote_engine_id="restarted"))
    assert pair.producer.collect() == []


def test_producer_close_ends_every_lease(pair):
    pair.producer.expose("a", [1], 2)
    pair.producer.expose("b", [2, 3], 5)
    pair.producer.close()
    assert pair.producer.leases.num_held_blocks == 0


def test_params_for_another_transport_are_refused(pair):
    other = "tcp" if pair.producer.name == "shm" else "shm"
    with contextlib.closing(Pair(other)) as foreign:
        params = foreign.producer.expose("x", [1], 1)
        with pytest.raises(KVProtocolError, match="transport is"):
            pair.consumer.fetch(params, plan_units(4, [1], [1]))


def test_background_receiver_reports_success_and_failure(pair):
    receiver = BackgroundReceiver(pair.consumer)
    good = pair.producer.expose("good", [7, 8, 9], 12)
    bad = pair.producer.expose("bad", [10], 1)
    pair.producer.leases.release("bad")  # someone else released it: the fetch is refused
    receiver.submit("local-good", good, [0, 1, 2])
    receiver.submit("local-bad", bad, [3])
    finished = []
    deadline = time.monotonic() + 30
    while len(finished) < 2 and time.monotonic() < deadline:
        finished += receiver.poll()
    receiver.close()
    outcome = {f.request_id: f for f in finished}
    assert outcome["local-good"].is_ok and outcome["local-good"].stats.num_bytes > 0
    assert isinstance(outcome["local-bad"].error, KVLeaseError)
    assert torch.equal(
        bits(pair.consumer.kv_cache[:, :, [0, 1, 2]]),
        bits(reference_cache(LAYOUT)[:, :, [7, 8, 9]]),
    )
    assert sorted(pair.producer.collect()) == ["bad", "good"]


def test_consumer_reconnects_after_server_dropped_idle_connection():
    with contextlib.closing(Pair("tcp", kv_idle_timeout=0.1)) as pair:
        pair.consumer.receive(pair.producer.expose("first", [1], 1), [1])
        # Wait (real clock) until the server's idle timeout has closed our connection.
        remote = next(iter(pair.consumer._remotes.values()))
        deadline = time.monotonic() + 10
        while not _peer_closed(remote.client._sock):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pair.consumer.receive(pair.producer.expose("second", [2], 1), [2])
        assert sorted(pair.producer.collect()) == ["first", "second"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_consumer_keeps_only_the_most_recently_used_remotes(monkeypatch, transport):
    # An autoscaled fleet's prefill workers come and go: the ones gone must not pile up.
    monkeypatch.setattr(transport_module, "MAX_REMOTES", 2)
    consumer = create_kv_transport(
        KVTransferConfig(transport=transport, kv_role="kv_consumer"), LAYOUT, NUM_BLOCKS
    )
    producers = [
        create_kv_transport(
            KVTransferConfig(transport=transport, kv_role="kv_producer"), LAYOUT, NUM_BLOCKS
        )
        for _ in range(3)
    ]
    try:
        clients = []
        for index, producer in enumerate(producers):
            consumer.receive(producer.expose(f"r{index}", [1], 1), [1])
            clients.append(next(reversed(consumer._remotes.values())).client)
        assert consumer.num_remotes == 2
        assert clients[0]._sock is None and clients[2]._sock is not None  # the oldest closed
        # A request to the evicted one reconnects.
        consumer.receive(producers[0].expose("again", [2], 1), [2])
        assert consumer.num_remotes == 2
    finally:
        for made in (consumer, *producers):
            made.close()


def _peer_closed(sock) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_shm_copy_that_outlives_its_lease_is_refused(monkeypatch):
    """If the lease expired while the receiver copied, the blocks may have been reused:
    RELEASE reports the lease dead and the received KV is refused."""
    now = [0.0]
    leases = LeaseManager(lease_timeout=5, clock=lambda: now[0])
    producer = ShmTransport(
        SharedKVCache.create(LAYOUT, NUM_BLOCKS),
        LAYOUT,
        KVTransferConfig(transport="shm", kv_role="kv_producer"),
        leases,
    )
    consumer = create_kv_transport(
        KVTransferConfig(transport="shm", kv_role="kv_consumer"), LAYOUT, NUM_BLOCKS
    )
    real_copy = shm_module.copy_blocks

    def slow_copy(*args):
        real_copy(*args)
        now[0] += 6  # the copy took longer than the lease

    monkeypatch.setattr(shm_module, "copy_blocks", slow_copy)
    try:
        params = producer.expose("slow", [1, 2], 5)
        with pytest.raises(KVLeaseError, match="ended before the transfer was confirmed"):
            consumer.receive(params, [1, 2])
        assert producer.collect() == ["slow"]
    finally:
        consumer.close()
        producer.close()


def test_shm_names_off_the_wire_cannot_escape_dev_shm():
    for name in ("../../etc/passwd", "pdserve-kv-1-../../x", "other", ""):
        with pytest.raises(KVProtocolError, match="not a pdserve KV segment name"):
            SharedKVCache.attach(name, LAYOUT)
    with pytest.raises(KVTransferError, match="needs both workers on one host"):
        SharedKVCache.attach("pdserve-kv-1-0123456789ab", LAYOUT)


def test_segments_of_dead_owners_are_removed():
    dead_pid = _dead_pid()
    stale = SHM_DIR / f"pdserve-kv-{dead_pid}-0123456789ab"
    stale.write_bytes(b"x")
    mine = SharedKVCache.create(LAYOUT, 1)
    try:
        assert not stale.exists()
        assert stale.name not in remove_stale_segments()
        assert (SHM_DIR / mine.name).exists()  # live owner's segment kept
    finally:
        mine.close()
    assert not (SHM_DIR / mine.name).exists()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_an_owner_exiting_without_close_unlinks_its_segment():
    code = (
        "import json, sys\nfrom pdserve.kv_transfer.protocol import KVLayout\n"
        "from pdserve.kv_transfer.shm import SharedKVCache\n"
        "layout = KVLayout(**json.loads(sys.argv[1]))\n"
        "print(SharedKVCache.create(layout, 2).name, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(LAYOUT.to_dict())],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    name = out.stdout.strip()
    assert name.startswith("pdserve-kv-")
    assert not (SHM_DIR / name).exists()


class RenamedTcp(transport_module.TcpTransport):
    name = "tcp-renamed"


def test_a_registered_transport_is_a_choice_the_config_and_the_connector_take():
    """A new transport is a `KVTransport` and one `register_transport`: `--kv-transport`
    offers it, the config accepts it, the connector makes it, a sender may offer it."""
    import argparse

    from pdserve.engine.args import KV_TRANSFER_FLAGS
    from pdserve.flags import add_flags
    from pdserve.kv_transfer import registry

    entry = registry.TransportEntry(__name__, "RenamedTcp", needs_shared_cache=False)
    registry.register_transport(RenamedTcp.name, entry)
    try:
        with pytest.raises(ValueError, match="registered already"):
            registry.register_transport(RenamedTcp.name, entry)
        parser = argparse.ArgumentParser()
        add_flags(parser, None, KV_TRANSFER_FLAGS)
        assert parser.parse_args(["--kv-transport", RenamedTcp.name]).kv_transport == "tcp-renamed"
        assert RenamedTcp.name in registry.offered_transports()
        config = KVTransferConfig(transport=RenamedTcp.name, kv_role="kv_consumer")
        assert not config.needs_shared_cache
        made = create_kv_transport(config, LAYOUT, NUM_BLOCKS)
        try:
            assert type(made) is RenamedTcp
        finally:
            made.close()
    finally:
        del registry.TRANSPORTS[RenamedTcp.name]
    with pytest.raises(ValueError, match="transport must be one of"):
        KVTransferConfig(transport=RenamedTcp.name)


def test_the_built_in_transports_are_registered_under_their_names():
    import importlib

    from pdserve.kv_transfer.registry import TRANSPORTS, offered_transports

    assert list(TRANSPORTS) == ["shm", "tcp", "auto"] and offered_transports() == ("shm", "tcp")
    for name, entry in TRANSPORTS.items():
        assert getattr(importlib.import_module(entry.module), entry.class_name).name == name
