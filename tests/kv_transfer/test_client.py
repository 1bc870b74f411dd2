"""The receiving side against a hostile or broken server: every bad answer becomes a clean
`KVTransferError` and the connection is dropped, never a hang or a crash."""

from __future__ import annotations

import socket
import threading

import pytest

from pdserve.kv_transfer import (
    FrameError,
    KVIncompatibleError,
    KVTransferConfig,
    KVTransferError,
    KVTransferParams,
    plan_units,
)
from pdserve.kv_transfer.client import KVClient
from pdserve.kv_transfer.connector import create_kv_transport
from pdserve.kv_transfer.wire import HEADER, MAGIC, MessageType, encode_frame, read_frame
from tests.kv_transfer.helpers import NUM_BLOCKS, tiny_layout

LAYOUT = tiny_layout()


class ScriptedServer:
    """Accepts one connection and answers each request frame with the next scripted bytes."""

    def __init__(self, replies: list[bytes]) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._replies = replies
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            for reply in self._replies:
                read_frame(conn, max_payload=0)
                conn.sendall(reply)
        self._listener.close()

    def join(self) -> None:
        self._thread.join(timeout=10)


def _hello(**overrides) -> bytes:
    meta = {
        "protocol_version": 1,
        "engine_id": "e1",
        "layout": LAYOUT.to_dict(),
        "num_blocks": NUM_BLOCKS,
        **overrides,
    }
    return encode_frame(MessageType.REPLY, meta)


def _params(port: int) -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="e1",
        remote_request_id="r",
        remote_host="127.0.0.1",
        remote_port=port,
        remote_block_ids=(1, 2),
        remote_num_tokens=8,
        transport="tcp",
        layout_hash=LAYOUT.layout_hash(),
    )


@pytest.mark.parametrize(
    ("reply", "error", "phrase"),
    [
        (b"HTTP/1.1 200 OK\r\n\r\n!", FrameError, "bad magic"),
        (HEADER.pack(MAGIC, 1, int(MessageType.REPLY), 2**31, 0), FrameError, "over the"),
        (HEADER.pack(MAGIC, 1, int(MessageType.REPLY), 50, 0) + b"{}", FrameError, "mid-frame"),
        (
            HEADER.pack(MAGIC, 1, int(MessageType.REPLY), 2, 10**12) + b"{}",
            FrameError,
            "payload length",
        ),
        (
            HEADER.pack(MAGIC, 7, int(MessageType.REPLY), 2, 0) + b"{}",
            KVIncompatibleError,
            "version 7",
        ),
        (encode_frame(MessageType.DATA, {}), FrameError, "expected REPLY"),
        (b"", KVTransferError, "closed the connection"),
    ],
)
def test_bad_replies_raise_cleanly(reply, error, phrase):
    server = ScriptedServer([reply])
    client = KVClient("127.0.0.1", server.port, timeout=5)
    with pytest.raises(error, match=phrase):
        client.call(MessageType.HELLO, {})
    server.join()
    client.close()


def _consumer():
    return create_kv_transport(
        KVTransferConfig(transport="tcp", kv_role="kv_consumer"), LAYOUT, NUM_BLOCKS
    )


@pytest.mark.parametrize(
    ("data_meta", "phrase"),
    [
        ({"dtype": "float16", "shape": [4, 2, 2, 4, 2, 8]}, "expected"),
        ({"dtype": "float32", "shape": [4, 2, 3, 4, 2, 8]}, "expected"),
    ],
)
def test_data_frame_of_wrong_dtype_or_shape_is_refused(data_meta, phrase):
    nbytes = LAYOUT.nbytes(2)
    data = encode_frame(MessageType.DATA, data_meta, payload_len=nbytes) + bytes(nbytes)
    server = ScriptedServer([_hello(), data])
    consumer = _consumer()
    with pytest.raises(FrameError, match=phrase):
        consumer.fetch(_params(server.port), _whole())
    assert not consumer.kv_cache.any()
    server.join()
    consumer.close()


def test_short_payload_is_refused():
    nbytes = LAYOUT.nbytes(2)
    data = encode_frame(
        MessageType.DATA, {"dtype": "float32", "shape": [4, 2, 2, 4, 2, 8]}, payload_len=nbytes
    ) + bytes(nbytes // 2)
    server = ScriptedServer([_hello(), data])
    consumer = _consumer()
    with pytest.raises(FrameError, match="mid-frame"):
        consumer.fetch(_params(server.port), _whole())
    server.join()
    consumer.close()


def test_hello_from_a_different_engine_is_stale():
    server = ScriptedServer([_hello(engine_id="restarted")])
    consumer = _consumer()
    with pytest.raises(KVTransferError, match="stale kv_transfer_params"):
        consumer.fetch(_params(server.port), _whole())
    server.join()
    consumer.close()


def test_hello_with_garbage_layout_is_refused():
    server = ScriptedServer([_hello(layout={"model_id": "x"})])
    consumer = _consumer()
    with pytest.raises(KVTransferError, match=r"HELLO\.layout\.num_layers is required"):
        consumer.fetch(_params(server.port), _whole())
    server.join()
    consumer.close()


def test_unreachable_server_is_a_transfer_error():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    consumer = _consumer()
    with pytest.raises(KVTransferError, match="cannot reach KV server"):
        consumer.receive(_params(port), [0, 1])
    consumer.close()


def _whole():
    return plan_units(LAYOUT.num_layers, [1, 2], [0, 1])
