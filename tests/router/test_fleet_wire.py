"""What an eavesdropper or a man in the middle of a guarded deployment's network gets: real
prefill and decode workers holding the fleet secret, an in-process router, and a TCP relay on
every path between them (router -> each worker's HTTP, decode worker -> the prefill worker's
KV port: the prefill KV server binds 127.0.0.2 and advertises the relay's 127.0.0.1 on the
same port).

- The secret crosses none of them, in any byte of a disaggregated request.
- A request the router signed, replayed as captured, is refused.
- DATA frames altered on the KV path fail the transfer; the decode worker recomputes the
  prompt (``--kv-failure-policy recompute``) and the request still completes.

And the same deployment with ``--fleet-tls`` credentials (a CA made here, as the launcher
makes one): the prompt, the answer and the KV bytes cross no relay in clear, the answer is the
one in clear, and a peer holding another CA's certificate is refused on HTTP and KV alike.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from pdserve.api.signing import FleetAuth
from pdserve.fleet import FLEET_SECRET_ENV, FleetCA
from pdserve.kv_transfer import KVAuthError
from pdserve.kv_transfer.client import KVClient
from pdserve.kv_transfer.protocol import KV_TRANSFER_PROTOCOL_VERSION
from pdserve.kv_transfer.wire import HEADER, MAGIC
from pdserve.ports import free_port
from pdserve.router.config import RouterConfig
from tests.relay import FlipDataPayloads, TcpRelay
from tests.router.harness import ManagedProcess, RouterThread
from tests.router.real_workers import STARTUP_TIMEOUT_S, assert_no_blocks_held, serve_argv

pytestmark = pytest.mark.slow

SECRET = "wire-test-fleet-secret-3f9c2a"
KV_HOST = "127.0.0.2"  # where the prefill KV server really listens; the relay has 127.0.0.1
PROMPT_WORDS = ("quiet", "river", "stone", "lamp", "north", "amber")


CA = FleetCA()  # what `pdserve serve --fleet-tls` makes for a deployment
STRANGER_CA = FleetCA()
# How every KV frame in clear begins (long enough not to occur in ciphertext by chance).
FRAME_START = MAGIC + KV_TRANSFER_PROTOCOL_VERSION.to_bytes(2, "big")


def _worker(logs, role: str, port: int, *flags: str, ca: FleetCA | None) -> ManagedProcess:
    argv = serve_argv(
        "--role", role, "--port", str(port), "--kv-transport", "tcp", "--num-threads", "1", *flags
    )
    env = {FLEET_SECRET_ENV: SECRET, **(ca.issue(role).to_env() if ca is not None else {})}
    return ManagedProcess(argv, logs / f"{role}.log", env=env)


def _deployment(logs, ca: FleetCA | None):
    """Prefill and decode workers (with `ca`'s certificates: --fleet-tls), relays on every
    path, and the router in this process: yields (router, relays, (prefill, decode, KV port))."""
    prefill_port, decode_port, kv_port = free_port(), free_port(), free_port()
    prefill = _worker(
        logs,
        "prefill",
        prefill_port,
        *("--kv-host", KV_HOST, "--kv-port", str(kv_port), "--kv-advertise-host", "127.0.0.1"),
        ca=ca,
    )
    decode = _worker(logs, "decode", decode_port, "--kv-failure-policy", "recompute", ca=ca)
    relays = {
        "prefill": TcpRelay(("127.0.0.1", prefill_port)),
        "decode": TcpRelay(("127.0.0.1", decode_port)),
        "kv": TcpRelay((KV_HOST, kv_port), port=kv_port),
    }
    scheme = "http" if ca is None else "https"
    verify = True if ca is None else ca.issue("test").client_context()
    try:
        for process, port in ((prefill, prefill_port), (decode, decode_port)):
            url = f"{scheme}://127.0.0.1:{port}/health"
            process.wait_healthy(url, STARTUP_TIMEOUT_S, verify=verify)
        urls = {
            name: f"{scheme}://{relay.address[0]}:{relay.address[1]}"
            for name, relay in relays.items()
        }
        config = RouterConfig(
            prefill_urls=(urls["prefill"],),
            decode_urls=(urls["decode"],),
            fleet_secret=SECRET,
            fleet_tls=ca.issue("router") if ca is not None else None,
            health_interval_s=0.5,
        )
        with RouterThread(config) as router:
            yield router, relays, (prefill_port, decode_port, kv_port)
    finally:
        for relay in relays.values():
            relay.close()
        for process in (prefill, decode):
            process.stop(timeout=60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    yield from _deployment(tmp_path_factory.mktemp("fleet-wire"), None)


@pytest.fixture(scope="module")
def tls_fleet(tmp_path_factory):
    yield from _deployment(tmp_path_factory.mktemp("fleet-tls"), CA)


def _prompt(marker: str) -> str:
    # A prompt of its own (first word): nothing of it is cached on either worker.
    return " ".join([marker, *(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(40))])


def _complete(router: RouterThread, marker: str) -> dict:
    prompt = _prompt(marker)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{router.url}/v1/completions", json=body, trust_env=False, timeout=600)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _timing(answer: dict) -> dict:
    return answer.get("pdserve_timing") or answer["usage"]["pdserve_timing"]


def test_the_secret_never_crosses_the_wire(fleet):
    router, relays, _ = fleet
    answer = _complete(router, "eavesdropped")
    assert answer["usage"]["completion_tokens"] == 6
    assert _timing(answer)["kv_transfer_bytes"] > 0  # the KV came over the relayed KV port
    for name, relay in relays.items():
        assert relay.sent and relay.answered, name
        assert SECRET.encode() not in relay.captured, name


def test_a_captured_signed_request_replayed_is_refused(fleet):
    router, relays, (prefill_port, _, _) = fleet
    _complete(router, "captured")
    sent = bytes(relays["prefill"].sent)
    start = sent.rindex(b"POST /v1/completions")
    head_end = sent.index(b"\r\n\r\n", start) + 4
    head = sent[start:head_end].decode()
    length = int(
        next(h for h in head.split("\r\n") if h.lower().startswith("content-length:"))[15:]
    )
    captured = sent[start : head_end + length]
    with socket.create_connection(("127.0.0.1", prefill_port), timeout=30) as sock:
        sock.sendall(captured)
        sock.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 401") and b"replayed" in reply


def test_altered_kv_frames_fail_the_transfer_and_the_request_is_recomputed(fleet):
    router, relays, (prefill_port, decode_port, _) = fleet
    flips: list[FlipDataPayloads] = []
    relays["kv"].new_tamperer = lambda: flips.append(FlipDataPayloads()) or flips[-1]
    # The decode worker keeps its KV connection: break it, so the next one is tampered.
    relays["kv"].drop_connections()
    try:
        answer = _complete(router, "tampered")
    finally:
        relays["kv"].new_tamperer = None
    assert sum(flip.num_flipped for flip in flips) >= 1
    timing = _timing(answer)
    assert "authentication failed" in timing["kv_transfer_error"]
    assert answer["usage"]["completion_tokens"] == 6
    # And the next request's KV arrives again, on a fresh connection.
    relays["kv"].drop_connections()
    assert _timing(_complete(router, "untouched"))["kv_transfer_bytes"] > 0
    urls = [f"http://127.0.0.1:{port}" for port in (prefill_port, decode_port)]
    assert_no_blocks_held(urls, auth=FleetAuth(SECRET))


def _kv_payload_samples(kv_answered: bytes) -> list[bytes]:
    """32-byte pieces of the DATA payloads in a KV connection's answers in clear."""
    samples, start = [], 0
    while (start := kv_answered.find(MAGIC, start)) >= 0:
        _, _, msg_type, meta_len, payload_len = HEADER.unpack_from(kv_answered, start)
        body = start + HEADER.size + meta_len
        if payload_len >= 4096 and msg_type == 17:  # DATA
            payload = kv_answered[body : body + payload_len]
            samples += [payload[i : i + 32] for i in range(1024, len(payload) - 32, 4096)]
        start = body + payload_len
    return samples


def test_with_fleet_tls_nothing_crosses_in_clear_and_the_answer_is_the_same(fleet, tls_fleet):
    plain_router, plain_relays, _ = fleet
    tls_router, relays, _ = tls_fleet
    before = len(plain_relays["kv"].answered)
    plain = _complete(plain_router, "encrypted")
    encrypted = _complete(tls_router, "encrypted")
    text = encrypted["choices"][0]["text"]
    assert text == plain["choices"][0]["text"] and len(text.strip()) > 0
    assert encrypted["usage"]["completion_tokens"] == 6
    assert _timing(encrypted)["kv_transfer_bytes"] > 0  # over the relayed KV port
    kv_in_clear = _kv_payload_samples(bytes(plain_relays["kv"].answered[before:]))
    assert len(kv_in_clear) >= 8  # the same prompt's KV, as it crosses a wire in clear
    prompt = _prompt("encrypted").encode()
    for name, relay in relays.items():
        captured = relay.captured
        assert relay.sent and relay.answered, name
        assert SECRET.encode() not in captured and b"encrypted" not in captured, name
        assert prompt[:24] not in captured and text.strip().encode() not in captured, name
        assert b"HTTP/1.1" not in captured and FRAME_START not in captured, name
        assert not any(sample in captured for sample in kv_in_clear), name


def test_with_fleet_tls_a_peer_holding_another_cas_certificate_is_refused(tls_fleet):
    _, _, (prefill_port, decode_port, kv_port) = tls_fleet
    stranger = STRANGER_CA.issue("router").client_context()
    member = CA.issue("router").client_context()
    for port in (prefill_port, decode_port):
        url = f"https://127.0.0.1:{port}/health"
        assert httpx.get(url, verify=member, trust_env=False, timeout=30).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=stranger, trust_env=False, timeout=30)
        with pytest.raises(httpx.HTTPError):  # nor in clear
            httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=30)
    with pytest.raises(KVAuthError, match="no TLS session"):
        KVClient(KV_HOST, kv_port, 30, SECRET, stranger).hello()
    client = KVClient(KV_HOST, kv_port, 30, SECRET, member)
    try:
        assert client.hello()["protocol_version"] >= 1
    finally:
        client.close()
