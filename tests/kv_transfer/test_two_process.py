"""KV blocks cross a real process boundary over shm and tcp, bit-exact, and the prefill side
frees exactly the leased blocks; hostile frames and mismatched workers are refused."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import torch

from pdserve.kv_transfer import (
    KVIncompatibleError,
    KVLeaseError,
    KVTransferConfig,
    KVTransferError,
    KVTransferParams,
    plan_units,
)
from pdserve.kv_transfer.connector import create_kv_transport
from pdserve.kv_transfer.shm import remove_stale_segments
from pdserve.kv_transfer.wire import HEADER, MAGIC, MessageType, encode_frame
from tests.kv_transfer.helpers import (
    NUM_BLOCKS,
    SenderProcess,
    SenderSpec,
    bits,
    reference_cache,
    tiny_layout,
)

SPECS = [SenderSpec(f"{t}-{d}", t, d) for t in ("shm", "tcp") for d in ("float32", "bfloat16")]
SPECS.append(SenderSpec("tcp-short-lease", "tcp", "float32", lease_timeout=0.3))

# Fragmented on both sides, so runs of consecutive blocks and single blocks are both copied.
REMOTE_IDS = [5, 6, 7, 20, 3, 40, 41]
LOCAL_IDS = [10, 11, 30, 31, 32, 2, 9]
NUM_TOKENS = 26  # 7 blocks of 4, the last one partly filled


@pytest.fixture(scope="module")
def sender():
    process = SenderProcess(SPECS)
    yield process
    process.stop()


def _consumer(transport: str, dtype: str, **layout_overrides):
    config = KVTransferConfig(transport=transport, kv_role="kv_consumer")
    return create_kv_transport(config, tiny_layout(dtype, **layout_overrides), NUM_BLOCKS)


def _expose(sender, key: str, request_id: str, block_ids=REMOTE_IDS, num_tokens=NUM_TOKENS):
    return KVTransferParams.from_dict(sender.call("expose", key, request_id, block_ids, num_tokens))


def _assert_blocks_equal(local_cache, local_ids, dtype, remote_ids=REMOTE_IDS):
    expected = reference_cache(tiny_layout(dtype))
    assert torch.equal(
        bits(local_cache[:, :, list(local_ids)]), bits(expected[:, :, list(remote_ids)])
    )


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact_and_release_frees_blocks(sender, transport, dtype):
    key = f"{transport}-{dtype}"
    consumer = _consumer(transport, dtype)
    try:
        params = _expose(sender, key, f"req-{key}")
        stats = consumer.receive(params, LOCAL_IDS)
        _assert_blocks_equal(consumer.kv_cache, LOCAL_IDS, dtype)
        assert stats.num_bytes == tiny_layout(dtype).nbytes(len(REMOTE_IDS))
        # Untouched local blocks stay zero.
        others = sorted(set(range(NUM_BLOCKS)) - set(LOCAL_IDS))
        assert not consumer.kv_cache[:, :, others].any()
        assert sender.call("collect", key) == [f"req-{key}"]
        assert sender.call("num_held_blocks", key) == 0
    finally:
        consumer.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_scattered_blocks_round_trip(sender, transport):
    """Many runs of one block each (the indexed copy path), as after prefix-cache churn."""
    key = f"{transport}-bfloat16"
    remote_ids = list(range(63, 15, -2))  # 24 blocks, descending, none consecutive
    local_ids = [(7 * i) % NUM_BLOCKS for i in range(1, 25)]
    consumer = _consumer(transport, "bfloat16")
    try:
        params = _expose(sender, key, "scattered", remote_ids, num_tokens=24 * 4)
        consumer.receive(params, local_ids)
        _assert_blocks_equal(consumer.kv_cache, local_ids, "bfloat16", remote_ids)
        assert sender.call("collect", key) == ["scattered"]
    finally:
        consumer.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_per_layer_units_and_prefix_skip(sender, transport):
    """The overlap-ready shape: one unit per layer; and a decode-side prefix-cache hit skips
    the first blocks."""
    key = f"{transport}-bfloat16"
    consumer = _consumer(transport, "bfloat16")
    try:
        params = _expose(sender, key, "per-layer")
        units = plan_units(4, REMOTE_IDS[2:], LOCAL_IDS[2:], layers_per_unit=1)
        stats = consumer.fetch(params, units)
        assert stats.num_units == 4
        assert consumer.release(params) is True
        _assert_blocks_equal(consumer.kv_cache, LOCAL_IDS[2:], "bfloat16", REMOTE_IDS[2:])

        params = _expose(sender, key, "skip")
        consumer.kv_cache.zero_()
        consumer.receive(params, LOCAL_IDS[:5], skip_blocks=2)
        _assert_blocks_equal(consumer.kv_cache, LOCAL_IDS[:5], "bfloat16", REMOTE_IDS[2:])
        assert not consumer.kv_cache[:, :, LOCAL_IDS[5:]].any()
        assert sorted(sender.call("collect", key)) == ["per-layer", "skip"]
    finally:
        consumer.close()


def test_lease_timeout_frees_unfetched_blocks(sender):
    key = "tcp-short-lease"
    consumer = _consumer("tcp", "float32")
    try:
        params = _expose(sender, key, "abandoned")
        assert sender.call("collect", key) == []  # still leased
        with pytest.raises(KVLeaseError, match="expired"):
            _wait_until_refused(consumer, params)
        assert sender.call("collect", key) == ["abandoned"]
        assert sender.call("num_held_blocks", key) == 0
    finally:
        consumer.close()


def _wait_until_refused(consumer, params) -> None:
    # Real clock: the 0.3 s lease runs out while we keep fetching (each fetch extends nothing:
    # tcp FETCH only pins during the read).
    units = plan_units(4, REMOTE_IDS, LOCAL_IDS)
    for _ in range(10_000):
        consumer.fetch(params, units)


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        ({"model_id": "other-model"}, "model differs"),
        ({"dtype": "bfloat16"}, "dtype differs"),
        ({"block_size": 8}, "block layout differs (block_size local 8 remote 4)"),
    ],
)
def test_mismatched_workers_are_refused_by_name(sender, overrides, phrase):
    dtype = overrides.pop("dtype", "float32")
    consumer = _consumer("tcp", dtype, **overrides)
    try:
        params = _expose(sender, "tcp-float32", f"mismatch-{phrase}")
        with pytest.raises(KVIncompatibleError, match="KV transfer refused") as info:
            consumer.receive(params, LOCAL_IDS)
        assert phrase in str(info.value)
        # The refused transfer still released the lease.
        assert sender.call("collect", "tcp-float32") == [f"mismatch-{phrase}"]
    finally:
        consumer.close()


def _header(version=1, msg_type=MessageType.HELLO, meta_len=0, payload_len=0, magic=MAGIC):
    return HEADER.pack(magic, version, int(msg_type), meta_len, payload_len)


HOSTILE_FRAMES = {
    "bad magic": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "huge metadata length": _header(meta_len=2**31),
    "payload on a request": _header(msg_type=MessageType.FETCH, payload_len=2**60),
    "unknown message type": struct.pack("!4sHHIQ", MAGIC, 1, 99, 0, 0),
    "truncated metadata": _header(meta_len=100) + b'{"request_id"',
    "truncated header": MAGIC + b"\x00",
    "not JSON": _header(meta_len=4) + b"\xff\xfe\x00{",
    "JSON array": _header(meta_len=2) + b"[]",
    "deeply nested JSON": _header(meta_len=200_000) + b"[" * 100_000 + b"]" * 100_000,
    "response type as request": _header(msg_type=MessageType.DATA, meta_len=2) + b"{}",
    "block_ids not a list": encode_frame(
        MessageType.FETCH, {"request_id": "x", "layer_start": 0, "layer_end": 1, "block_ids": "1,2"}
    ),
    "layer out of range": encode_frame(
        MessageType.FETCH, {"request_id": "x", "layer_start": 0, "layer_end": 999, "block_ids": [1]}
    ),
    "block id too large": encode_frame(
        MessageType.FETCH,
        {"request_id": "x", "layer_start": 0, "layer_end": 1, "block_ids": [2**70]},
    ),
    "request_id not a string": encode_frame(MessageType.RELEASE, {"request_id": 7}),
}


def _send_raw(port: int, data: bytes) -> bytes:
    """Send bytes, half-close, and read everything the server answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _parse_frames(data: bytes) -> list[tuple[int, dict]]:
    frames = []
    while data:
        magic, _, msg_type, meta_len, payload_len = HEADER.unpack(data[: HEADER.size])
        assert magic == MAGIC and payload_len == 0
        frames.append((msg_type, json.loads(data[HEADER.size : HEADER.size + meta_len])))
        data = data[HEADER.size + meta_len :]
    return frames


def _error_reply(reply: bytes) -> dict:
    [(msg_type, meta)] = _parse_frames(reply)
    assert msg_type == MessageType.ERROR
    return meta


def test_hostile_frames_are_rejected_and_server_keeps_serving(sender):
    key = "tcp-float32"
    port = _expose(sender, key, "probe").remote_port
    for name, frame in HOSTILE_FRAMES.items():
        reply = _send_raw(port, frame)
        assert _error_reply(reply)["code"] == "bad_request", name

    consumer = _consumer("tcp", "float32")
    try:
        params = _expose(sender, key, "after-attack")
        consumer.receive(params, LOCAL_IDS)
        _assert_blocks_equal(consumer.kv_cache, LOCAL_IDS, "float32")
        consumer.receive(_expose(sender, key, "after-attack-2"), LOCAL_IDS)
    finally:
        consumer.close()
    freed = sender.call("collect", key)
    assert sorted(freed) == ["after-attack", "after-attack-2"]  # "probe" still leased
    assert sender.call("num_held_blocks", key) == len(REMOTE_IDS)


def test_foreign_protocol_version_on_the_wire_is_refused(sender):
    port = _expose(sender, "tcp-float32", "version-probe").remote_port
    reply = _error_reply(_send_raw(port, _header(version=2, meta_len=2) + b"{}"))
    assert reply["code"] == "incompatible"
    assert "version 2" in reply["error"]


def test_fetch_of_blocks_outside_the_lease_keeps_connection(sender):
    """A semantic refusal is not a malformed frame: ERROR, and the connection stays usable."""
    port = _expose(sender, "tcp-float32", "lease-scope").remote_port
    fetch = encode_frame(
        MessageType.FETCH,
        {"request_id": "lease-scope", "layer_start": 0, "layer_end": 1, "block_ids": [63]},
    )
    [(first_type, first), (second_type, second)] = _parse_frames(
        _send_raw(port, fetch + encode_frame(MessageType.HELLO, {}))
    )
    assert first_type == MessageType.ERROR
    assert first["code"] == "lease" and "not leased" in first["error"]
    assert second_type == MessageType.REPLY and second["engine_id"]


@pytest.mark.slow
def test_killed_prefill_worker_fails_the_transfer_cleanly():
    """kill -9 of the sender after the hand-off: the receiver gets a KVTransferError (the
    decode side then recomputes or fails the request) and drops its connection and mapping."""
    process = SenderProcess(
        [SenderSpec("shm", "shm", "float32"), SenderSpec("tcp", "tcp", "float32")]
    )
    consumers = {t: _consumer(t, "float32") for t in ("shm", "tcp")}
    try:
        for transport, consumer in consumers.items():
            consumer.receive(_expose(process, transport, "before"), LOCAL_IDS)
            assert consumer.num_remotes == 1
        pending = {t: _expose(process, t, "orphan") for t in consumers}
        process.kill()
        for transport, consumer in consumers.items():
            with pytest.raises(KVTransferError):
                consumer.receive(pending[transport], LOCAL_IDS)
            assert consumer.num_remotes == 0
        # The dead owner's shared segment is swept by the next worker on this host.
        assert pending["shm"].shm_name in remove_stale_segments()
    finally:
        for consumer in consumers.values():
            consumer.close()
