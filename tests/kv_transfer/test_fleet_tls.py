"""`--fleet-tls` on the KV port: every connection is mutual TLS under the deployment's CA,
with the secret's handshake and sealed frames inside. On the wire nothing of the protocol
shows (no frame header, no KV byte); a peer holding a certificate of another CA, or none, is
refused whichever side it is on, and the lease it asked for stays with its owner."""

from __future__ import annotations

import pytest

from pdserve.fleet import FleetCA
from pdserve.kv_transfer import KVAuthError, KVTransferError, plan_units
from pdserve.kv_transfer.client import release_lease
from pdserve.kv_transfer.protocol import KV_TRANSFER_PROTOCOL_VERSION
from pdserve.kv_transfer.wire import MAGIC
from tests.kv_transfer.helpers import bits
from tests.kv_transfer.test_fleet_secret import (
    LAYOUT,
    SECRET,
    _through,
    closing_all,
    consumer,
    producer,
    relay_to,
)

CA = FleetCA()
STRANGER_CA = FleetCA()
# How every KV frame in clear begins (long enough not to occur in ciphertext by chance).
FRAME_START = MAGIC + KV_TRANSFER_PROTOCOL_VERSION.to_bytes(2, "big")


def test_a_transfer_in_tls_shows_no_frame_and_no_kv_byte_on_the_wire():
    sender = producer(tls=CA.issue("prefill-0"))
    with closing_all(sender, consumer(tls=CA.issue("decode-0"))) as (_, receiver):
        params = sender.expose("encrypted", [3, 4], 8)
        with relay_to(params) as relay:
            receiver.receive(_through(relay, params), [10, 11])
        sent = sender.kv_cache[:, :, [3, 4]]
        assert bool((bits(receiver.kv_cache[:, :, [10, 11]]) == bits(sent)).all())
        assert sender.collect() == ["encrypted"]
        captured = relay.captured
        assert len(captured) > sender.layout.nbytes(2, LAYOUT.num_layers)
        assert FRAME_START not in captured and SECRET.encode() not in captured
        kv_bytes = sent.contiguous().numpy().tobytes()
        assert not any(kv_bytes[i : i + 32] in captured for i in range(0, len(kv_bytes), 4096))


def test_a_receiver_with_another_cas_certificate_gets_nothing_and_the_lease_stays():
    sender = producer(tls=CA.issue("prefill-0"))
    with closing_all(sender, consumer(tls=STRANGER_CA.issue("decode-0"))) as (_, stranger):
        params = sender.expose("private", [5], 4)
        with pytest.raises(KVAuthError, match="no TLS session"):
            stranger.fetch(params, plan_units(LAYOUT.num_layers, [5], [0]))
        assert not stranger.kv_cache.any()
        # Nor can it free the blocks, even holding the secret; a member can.
        stranger_tls = STRANGER_CA.issue("router").client_context()
        with pytest.raises(KVAuthError):
            release_lease(params, timeout=5, secret=SECRET, tls=stranger_tls)
        assert sender.leases.num_held_blocks == 1
        member_tls = CA.issue("router").client_context()
        assert release_lease(params, timeout=5, secret=SECRET, tls=member_tls) is True


def test_a_receiver_without_tls_is_refused():
    sender = producer(tls=CA.issue("prefill-0"))
    with closing_all(sender, consumer()) as (_, plain):
        params = sender.expose("r", [6], 4)
        with pytest.raises(KVTransferError):
            plain.fetch(params, plan_units(LAYOUT.num_layers, [6], [0]))
        assert not plain.kv_cache.any()
        assert sender.leases.num_held_blocks == 1


def test_a_member_refuses_a_server_with_another_cas_certificate():
    impostor = producer(tls=STRANGER_CA.issue("prefill-0"))
    with closing_all(impostor, consumer(tls=CA.issue("decode-0"))) as (_, member):
        params = impostor.expose("r", [7], 4)
        with pytest.raises(KVAuthError, match="no TLS session"):
            member.fetch(params, plan_units(LAYOUT.num_layers, [7], [0]))


def test_the_key_is_in_no_repr():
    tls = CA.issue("prefill-0")
    with closing_all(producer(tls=tls)) as (sender,):
        assert tls.key_pem not in repr(sender.config) and "PRIVATE" not in repr(tls)
