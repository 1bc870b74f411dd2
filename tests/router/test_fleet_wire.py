"""What an eavesdropper or a man in the middle of a guarded deployment's network gets: real
prefill and decode workers holding the fleet secret, an in-process router, and a TCP relay on
every path between them (router -> each worker's HTTP, decode worker -> the prefill worker's
KV port: the prefill KV server binds 127.0.0.2 and advertises the relay's 127.0.0.1 on the
same port).

- The secret crosses none of them, in any byte of a disaggregated request.
- A request the router signed, replayed as captured, is refused.
- DATA frames altered on the KV path fail the transfer; the decode worker recomputes the
  prompt (``--kv-failure-policy recompute``) and the request still completes.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from pdserve.api.signing import FleetAuth
from pdserve.fleet import FLEET_SECRET_ENV
from pdserve.router.config import RouterConfig
from tests.relay import FlipDataPayloads, TcpRelay
from tests.router.harness import ManagedProcess, RouterThread, free_port
from tests.router.real_workers import STARTUP_TIMEOUT_S, assert_no_blocks_held, serve_argv

pytestmark = pytest.mark.slow

SECRET = "wire-test-fleet-secret-3f9c2a"
KV_HOST = "127.0.0.2"  # where the prefill KV server really listens; the relay has 127.0.0.1
PROMPT_WORDS = ("quiet", "river", "stone", "lamp", "north", "amber")


def _worker(logs, role: str, port: int, *flags: str) -> ManagedProcess:
    argv = serve_argv(
        "--role", role, "--port", str(port), "--kv-transport", "tcp", "--num-threads", "1", *flags
    )
    return ManagedProcess(argv, logs / f"{role}.log", env={FLEET_SECRET_ENV: SECRET})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-wire")
    prefill_port, decode_port, kv_port = free_port(), free_port(), free_port()
    prefill = _worker(
        logs,
        "prefill",
        prefill_port,
        *("--kv-host", KV_HOST, "--kv-port", str(kv_port), "--kv-advertise-host", "127.0.0.1"),
    )
    decode = _worker(logs, "decode", decode_port, "--kv-failure-policy", "recompute")
    relays = {
        "prefill": TcpRelay(("127.0.0.1", prefill_port)),
        "decode": TcpRelay(("127.0.0.1", decode_port)),
        "kv": TcpRelay((KV_HOST, kv_port), port=kv_port),
    }
    try:
        for process, port in ((prefill, prefill_port), (decode, decode_port)):
            process.wait_healthy(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S)
        config = RouterConfig(
            prefill_urls=(relays["prefill"].url,),
            decode_urls=(relays["decode"].url,),
            fleet_secret=SECRET,
            health_interval_s=0.5,
        )
        with RouterThread(config) as router:
            yield router, relays, (prefill_port, decode_port)
    finally:
        for relay in relays.values():
            relay.close()
        for process in (prefill, decode):
            process.stop(timeout=60)


def _complete(router: RouterThread, marker: str) -> dict:
    # A prompt of its own (first word): nothing of it is cached on either worker.
    prompt = " ".join([marker, *(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(40))])
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
    router, relays, (prefill_port, _) = fleet
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
    router, relays, (prefill_port, decode_port) = fleet
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
