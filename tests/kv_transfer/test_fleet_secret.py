"""Only the fleet gets in: a KV server with the deployment's secret serves only peers that prove
they hold it (HMAC challenge-response, the secret never on the wire), and a receiver proves it
and checks the server's proof; every frame after that is sealed with the connection's session
keys, so a frame altered, replayed or reordered on the wire fails the transfer. `--kv-transport
auto` picks shared memory or tcp per pair."""

from __future__ import annotations

import contextlib
import dataclasses
import socket

import pytest

from pdserve.kv_transfer import (
    FrameError,
    KVAuthError,
    KVTransferConfig,
    KVTransferParams,
    plan_units,
)
from pdserve.kv_transfer.client import release_lease
from pdserve.kv_transfer.connector import create_kv_transport
from pdserve.kv_transfer.wire import (
    MessageType,
    Session,
    encode_frame,
    proof,
    read_frame,
    send_frame,
)
from tests.kv_transfer.helpers import NUM_BLOCKS, bits, reference_cache, tiny_layout
from tests.relay import FlipDataPayloads, TcpRelay

LAYOUT = tiny_layout()
SECRET = "fleet-secret-for-tests"


def producer(transport: str = "tcp", secret: str | None = SECRET, **config):
    made = create_kv_transport(
        KVTransferConfig(transport=transport, kv_role="kv_producer", secret=secret, **config),
        LAYOUT,
        NUM_BLOCKS,
    )
    made.kv_cache.copy_(reference_cache(LAYOUT))
    return made


def consumer(transport: str = "tcp", secret: str | None = SECRET, **config):
    return create_kv_transport(
        KVTransferConfig(transport=transport, kv_role="kv_consumer", secret=secret, **config),
        LAYOUT,
        NUM_BLOCKS,
    )


@contextlib.contextmanager
def closing_all(*transports):
    try:
        yield transports
    finally:
        for transport in transports:
            transport.close()


def _receive_matches(sender, receiver, request_id: str) -> bool:
    params = sender.expose(request_id, [3, 4], 8)
    receiver.receive(params, [10, 11])
    sent = bits(sender.kv_cache[:, :, [3, 4]])
    return bool((bits(receiver.kv_cache[:, :, [10, 11]]) == sent).all())


def test_members_transfer_and_release():
    with closing_all(producer(), consumer()) as (sender, receiver):
        assert _receive_matches(sender, receiver, "member")
        assert sender.collect() == ["member"]
        assert sender.leases.num_held_blocks == 0


def test_a_receiver_without_the_secret_gets_nothing_and_the_lease_stays():
    with closing_all(producer(), consumer(secret=None)) as (sender, outsider):
        params = sender.expose("private", [5], 4)
        with pytest.raises(KVAuthError, match="holds no fleet secret"):
            outsider.fetch(params, plan_units(LAYOUT.num_layers, [5], [0]))
        assert not outsider.kv_cache.any()  # not one byte arrived
        with pytest.raises(KVAuthError):
            release_lease(params, timeout=5)  # nor can it free a user's blocks
        assert sender.leases.num_held_blocks == 1
        assert release_lease(params, timeout=5, secret=SECRET) is True


def test_another_deployments_secret_is_refused_both_ways():
    with closing_all(producer(), consumer(secret="other-fleet")) as (sender, stranger):
        params = sender.expose("r", [6], 4)
        # The stranger checks the server's proof first and finds it made with another secret.
        with pytest.raises(KVAuthError, match="failed to prove membership"):
            stranger.fetch(params, plan_units(LAYOUT.num_layers, [6], [0]))
        assert not stranger.kv_cache.any()


def test_a_member_refuses_a_server_outside_the_fleet():
    with closing_all(producer(secret=None), consumer()) as (open_server, member):
        params = open_server.expose("r", [7], 4)
        with pytest.raises(KVAuthError, match="holds no fleet secret"):
            member.fetch(params, plan_units(LAYOUT.num_layers, [7], [0]))


def _frames(sock: socket.socket, *frames: bytes) -> list:
    sock.sendall(b"".join(frames))
    return [read_frame(sock, max_payload=0) for _ in frames]


def test_on_the_wire_nothing_is_served_before_the_proof_and_the_secret_never_appears():
    with closing_all(producer()) as (sender,):
        params = sender.expose("user-prompt", [8, 9], 8)
        address = (params.remote_host, params.remote_port)
        fetch = encode_frame(
            MessageType.FETCH,
            {"request_id": "user-prompt", "layer_start": 0, "layer_end": 1, "block_ids": [8]},
        )
        with socket.create_connection(address, timeout=10) as sock:
            [refusal] = _frames(sock, fetch)
            assert refusal.msg_type is MessageType.ERROR
            assert refusal.meta["code"] == "unauthorized"
            assert sock.recv(1) == b""  # and the connection is closed
        with socket.create_connection(address, timeout=10) as sock:
            [challenge] = _frames(sock, encode_frame(MessageType.HELLO, {"nonce": "ab" * 16}))
            # No engine id, layout or shm segment name before the proof: only the challenge.
            assert challenge.msg_type is MessageType.CHALLENGE
            assert set(challenge.meta) == {"nonce", "proof"}
            assert SECRET not in str(challenge.meta)
            [wrong] = _frames(sock, encode_frame(MessageType.AUTH, {"proof": "0" * 64}))
            assert wrong.meta["code"] == "unauthorized"
        assert sender.leases.num_held_blocks == 2


def test_a_proof_is_good_for_its_own_challenge_only():
    with closing_all(producer()) as (sender,):
        params = sender.expose("r", [2], 4)
        address = (params.remote_host, params.remote_port)
        with socket.create_connection(address, timeout=10) as first:
            [challenge] = _frames(first, encode_frame(MessageType.HELLO, {"nonce": "cd" * 16}))
            answer = proof(SECRET, "client", challenge.meta["nonce"], "cd" * 16)
            [hello] = _frames(first, encode_frame(MessageType.AUTH, {"proof": answer}))
            assert hello.msg_type is MessageType.REPLY
            assert hello.meta["engine_id"] == sender.engine_id
        with socket.create_connection(address, timeout=10) as replay:
            _frames(replay, encode_frame(MessageType.HELLO, {"nonce": "cd" * 16}))
            [refusal] = _frames(replay, encode_frame(MessageType.AUTH, {"proof": answer}))
            assert refusal.meta["code"] == "unauthorized"
        # A server proof replayed as a client's is refused too (the speaker is in the MAC).
        with socket.create_connection(address, timeout=10) as reflect:
            [challenge] = _frames(reflect, encode_frame(MessageType.HELLO, {"nonce": "ef" * 16}))
            reflected = {"proof": challenge.meta["proof"]}
            [refusal] = _frames(reflect, encode_frame(MessageType.AUTH, reflected))
            assert refusal.meta["code"] == "unauthorized"


@pytest.mark.parametrize(("receiver_node", "path"), [("node-a", "shm"), ("node-b", "tcp")])
def test_auto_transport_uses_shm_on_one_node_and_tcp_across(receiver_node, path):
    sender = producer("auto", kv_node_id="node-a")
    receiver = consumer("auto", kv_node_id=receiver_node)
    with closing_all(sender, receiver):
        assert _receive_matches(sender, receiver, "r")
        [remote] = receiver._remotes.values()
        assert (remote.attachment is not None) == (path == "shm")
        # A plain tcp sender's offer is taken too.
        with closing_all(producer("tcp")) as (tcp_sender,):
            assert _receive_matches(tcp_sender, receiver, "r2")


def test_params_carry_no_secret():
    with closing_all(producer()) as (sender,):
        params = sender.expose("r", [1], 1)
        assert SECRET not in str(params.to_dict())
        assert SECRET not in repr(sender.config)
        assert KVTransferParams.from_dict(params.to_dict()) == params


def _through(relay: TcpRelay, params: KVTransferParams) -> KVTransferParams:
    host, port = relay.address
    return dataclasses.replace(params, remote_host=host, remote_port=port)


@contextlib.contextmanager
def relay_to(params: KVTransferParams):
    relay = TcpRelay((params.remote_host, params.remote_port))
    try:
        yield relay
    finally:
        relay.close()


def test_a_transfer_seen_on_the_wire_carries_no_secret():
    with closing_all(producer(), consumer()) as (sender, receiver):
        params = sender.expose("watched", [3, 4], 8)
        with relay_to(params) as relay:
            receiver.receive(_through(relay, params), [10, 11])
        assert bool(
            (bits(receiver.kv_cache[:, :, [10, 11]]) == bits(sender.kv_cache[:, :, [3, 4]])).all()
        )
        assert len(relay.captured) > sender.layout.nbytes(2, LAYOUT.num_layers)
        assert SECRET.encode() not in relay.captured


def test_a_tampered_data_frame_fails_the_transfer_and_the_lease_is_freed():
    with closing_all(producer(), consumer()) as (sender, receiver):
        params = sender.expose("tampered", [3, 4], 8)
        with relay_to(params) as relay:
            flips = []
            relay.new_tamperer = lambda: flips.append(FlipDataPayloads()) or flips[-1]
            with pytest.raises(FrameError, match="frame authentication failed"):
                receiver.receive(_through(relay, params), [10, 11])
            assert sum(flip.num_flipped for flip in flips) == 1
            # The failed receive released the lease (a RELEASE carries no DATA to flip).
            assert sender.collect() == ["tampered"]
            # The tampered connection was dropped; the next transfer reconnects and succeeds.
            relay.new_tamperer = None
            assert _receive_matches_via(relay, sender, receiver, "clean")


def _receive_matches_via(relay, sender, receiver, request_id: str) -> bool:
    params = sender.expose(request_id, [5, 6], 8)
    receiver.receive(_through(relay, params), [20, 21])
    sent = bits(sender.kv_cache[:, :, [5, 6]])
    return bool((bits(receiver.kv_cache[:, :, [20, 21]]) == sent).all())


def _sealed(session: Session, meta: dict) -> bytes:
    """The bytes `send_frame` puts on the wire for `meta` under `session`."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_frame(ours, MessageType.REPLY, meta, session=session)
        ours.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: theirs.recv(65536), b""))


def _open(session: Session, *frames: bytes) -> list[dict]:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(b"".join(frames))
        return [read_frame(theirs, max_payload=0, session=session).meta for _ in frames]


def test_sealed_frames_cannot_be_replayed_reordered_reflected_or_moved():
    def pair(server_nonce: str = "5" * 32) -> tuple[Session, Session]:
        return (
            Session(SECRET, "c" * 32, server_nonce, is_client=True),
            Session(SECRET, "c" * 32, server_nonce, is_client=False),
        )

    client, server = pair()
    first, second = _sealed(client, {"n": 1}), _sealed(client, {"n": 2})
    assert _open(server, first, second) == [{"n": 1}, {"n": 2}]
    for receiver, frame in [
        (server, first),  # replayed
        (pair()[1], second),  # reordered
        (pair()[0], first),  # reflected to its sender
        (pair("6" * 32)[1], first),  # moved to another connection
        (pair()[1], first.replace(b'"n":1', b'"n":7')),  # altered
    ]:
        with pytest.raises(FrameError, match="frame authentication failed"):
            _open(receiver, frame)
