"""`KVStore` on a real redis-server: blocks round-trip bit-exact, lookups take one round trip,
and every fault (garbage, truncation, foreign writers, other tenants, a killed, restarted,
slow or password-protected server, a full write queue) is a counted miss, never an error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from pdserve.kv_store import ErrorKind, KVStore
from pdserve.kv_store.codec import encode_block
from pdserve.kv_store.config import KV_STORE_PASSWORD_ENV
from tests.kv_store.conftest import (
    REPO_ROOT,
    TINY,
    RedisServer,
    blocks_equal,
    empty_cache,
    make_sequence,
    sleep_past_backoff,
)


def _errors(store: KVStore, kind: ErrorKind) -> float:
    return store.metrics.value("pdserve:kv_store_errors_total", kind=kind.value)


def _write_all(store: KVStore, seq) -> None:
    assert store.write(seq.blocks, seq.cache_bytes, seq.block_ids) == len(seq.blocks)
    assert store.flush()


def _fetch(store: KVStore, seq, num_blocks: int | None = None):
    blocks = seq.blocks[:num_blocks]
    dest = empty_cache()
    dest_ids = list(range(len(blocks)))
    return store.fetch(blocks, dest.view(np.uint8).reshape(4, 64, -1), dest_ids), dest, dest_ids


def test_blocks_round_trip_bit_exact_with_metrics(redis_server, make_store):
    writer, reader = make_store(redis_server.url), make_store(redis_server.url)
    seq = make_sequence(6)
    _write_all(writer, seq)
    assert reader.lookup(seq.blocks) == 6
    num_read, dest, dest_ids = _fetch(reader, seq)
    assert num_read == 6
    assert blocks_equal(seq.cache, seq.block_ids, dest, dest_ids)
    value_bytes = 6 * writer.value_nbytes
    assert writer.metrics.value("pdserve:kv_store_written_bytes_total") == value_bytes
    assert reader.metrics.value("pdserve:kv_store_read_bytes_total") == value_bytes
    assert reader.metrics.value("pdserve:kv_store_hit_tokens_total") == 6 * TINY.block_size
    assert reader.metrics.value("pdserve:kv_store_lookup_tokens_total") == 6 * TINY.block_size
    assert reader.metrics.value("pdserve:kv_store_fetch_seconds_count") == 1


def test_writer_skips_keys_the_store_has(redis_server, make_store):
    first, second = make_store(redis_server.url), make_store(redis_server.url)
    seq = make_sequence(4)
    _write_all(first, seq)
    _write_all(second, seq)  # same blocks computed on another worker
    assert second.metrics.value("pdserve:kv_store_written_bytes_total") == 0
    # The 4 values once, and each writer's 4 in-flight markers (announced before it knew).
    assert redis_server.client().info("commandstats")["cmdstat_set"]["calls"] == 4 + 2 * 4


def test_lookup_finds_the_longest_leading_run_in_one_round_trip(
    redis_server, make_store, monkeypatch
):
    store = make_store(redis_server.url)
    seq = make_sequence(8)
    # Blocks 0-2 and 4-7 stored, 3 missing: only the leading run counts.
    store.write(
        seq.blocks[:3] + seq.blocks[4:], seq.cache_bytes, seq.block_ids[:3] + seq.block_ids[4:]
    )
    assert store.flush()
    sends = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sends.append(command)
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    assert store.lookup(seq.blocks) == 3
    assert len(sends) == 1  # every EXISTS in one write, answered together
    assert store.lookup(seq.blocks[4:]) == 4
    assert store.lookup([]) == 0


def test_garbage_value_is_a_counted_miss_and_is_replaced(redis_server, make_store):
    store = make_store(redis_server.url)
    seq = make_sequence(5)
    _write_all(store, seq)
    redis_server.client().set(store.keys.key(seq.blocks[2].block_hash), b"\x00garbage" * 100)
    num_read, dest, dest_ids = _fetch(store, seq)
    assert num_read == 2  # blocks after the bad one are computed, not read
    assert blocks_equal(seq.cache, seq.block_ids[:2], dest, dest_ids[:2])
    assert _errors(store, ErrorKind.CORRUPT) == 1
    # The bad value was deleted, so the next writer of that block replaces it.
    assert store.lookup(seq.blocks) == 2
    _write_all(store, seq)
    assert _fetch(store, seq)[0] == 5


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (lambda v: v[: len(v) // 2], ErrorKind.TRUNCATED),
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), ErrorKind.CORRUPT),  # one flipped bit
        (lambda v: v[:4] + b"\x09\x00" + v[6:], ErrorKind.VERSION),
    ],
    ids=["truncated", "bit-flip", "version"],
)
def test_damaged_value_is_rejected_by_kind(redis_server, make_store, damage, kind):
    store = make_store(redis_server.url)
    seq = make_sequence(2)
    _write_all(store, seq)
    raw = redis_server.client()
    key = store.keys.key(seq.blocks[0].block_hash)
    raw.set(key, damage(raw.get(key)))
    assert _fetch(store, seq)[0] == 0
    assert _errors(store, kind) == 1


def test_value_for_another_block_under_the_key_is_a_mismatch(redis_server, make_store):
    store = make_store(redis_server.url)
    seq, other = make_sequence(2, seed=1), make_sequence(2, seed=2)
    _write_all(store, other)
    raw = redis_server.client()
    raw.set(
        store.keys.key(seq.blocks[0].block_hash),
        raw.get(store.keys.key(other.blocks[0].block_hash)),
    )
    assert _fetch(store, seq)[0] == 0
    assert _errors(store, ErrorKind.MISMATCH) == 1


def test_foreign_fingerprint_never_hits(redis_server, make_store):
    from dataclasses import replace

    ours = make_store(redis_server.url)
    foreign_fp = replace(TINY, dtype="float16", kv_dtype="float16")
    foreign = make_store(redis_server.url, fingerprint=foreign_fp)
    seq = make_sequence(3)
    foreign_seq = make_sequence(3, fingerprint=foreign_fp)
    assert foreign_seq.token_ids == seq.token_ids  # the same prompt...
    _write_all(foreign, foreign_seq)
    assert ours.lookup(seq.blocks) == 0  # ...under other keys
    # Even a foreign value planted under our key is refused.
    payload = np.ascontiguousarray(foreign_seq.cache_bytes[:, foreign_seq.block_ids[0]])
    value = encode_block(foreign.keys.fingerprint_digest, seq.blocks[0], payload.tobytes())
    redis_server.client().set(ours.keys.key(seq.blocks[0].block_hash), value)
    assert _fetch(ours, seq)[0] == 0
    assert _errors(ours, ErrorKind.FOREIGN) == 1


def test_namespaces_are_isolated(redis_server, make_store):
    tenant_a = make_store(redis_server.url, namespace="tenant-a")
    tenant_b = make_store(redis_server.url, namespace="tenant-b")
    also_a = make_store(redis_server.url, namespace="tenant-a")
    seq = make_sequence(4)
    _write_all(tenant_a, seq)
    assert tenant_b.lookup(seq.blocks) == 0
    assert also_a.lookup(seq.blocks) == 4


def test_killed_server_means_misses_then_hits_after_restart(redis_server, make_store):
    store = make_store(redis_server.url, timeout_s=0.2)
    seq = make_sequence(4)
    _write_all(store, seq)
    redis_server.kill()
    start = time.monotonic()
    assert store.lookup(seq.blocks) == 0
    assert _fetch(store, seq)[0] == 0  # backing off: not even tried
    assert store.write(seq.blocks, seq.cache_bytes, seq.block_ids) == 0
    assert time.monotonic() - start < 1.0  # misses are fast, never a stall
    assert _errors(store, ErrorKind.CONNECTION) == 1
    assert store.metrics.value("pdserve:kv_store_dropped_writes_total") == 4
    redis_server.start()  # same port, empty
    sleep_past_backoff(store)
    assert store.lookup(seq.blocks) == 0  # reconnected; the blocks are gone
    _write_all(store, seq)
    assert store.lookup(seq.blocks) == 4
    assert _fetch(store, seq)[0] == 4


def test_slow_server_times_out_to_a_miss(redis_server, make_store):
    store = make_store(redis_server.url, timeout_s=0.2)
    seq = make_sequence(2)
    _write_all(store, seq)
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1.0")
    )
    sleeper.start()
    time.sleep(0.1)
    assert store.lookup(seq.blocks) == 0
    assert sleeper.is_alive()  # the lookup gave up before the server woke
    assert _errors(store, ErrorKind.TIMEOUT) == 1
    sleeper.join()
    sleep_past_backoff(store)
    assert store.lookup(seq.blocks) == 2


def test_full_write_queue_drops_and_counts(redis_server, make_store):
    # Room for three values; the server is frozen, so the write thread cannot drain.
    store = make_store(redis_server.url, timeout_s=5.0, write_queue_mb=3.5 * 1108 / 2**20)
    seq = make_sequence(20)
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1.0")
    )
    sleeper.start()
    time.sleep(0.1)
    queued = sum(
        store.write([b], seq.cache_bytes, [i])
        for b, i in zip(seq.blocks, seq.block_ids, strict=True)
    )
    assert sleeper.is_alive()  # never waits for the store: it is still asleep
    assert 1 <= queued <= 4
    assert store.metrics.value("pdserve:kv_store_dropped_writes_total") == 20 - queued
    sleeper.join()
    assert store.flush()
    assert store.lookup(seq.blocks) == queued


def test_password_urls_work_and_a_wrong_password_is_a_miss(tmp_path, make_store, caplog):
    server = RedisServer(tmp_path, "--requirepass", "s3cret")
    try:
        good = make_store(f"redis://:s3cret@127.0.0.1:{server.port}/2")
        named = make_store(f"redis://default:s3cret@127.0.0.1:{server.port}/2")
        bad = make_store(f"redis://default:wrong@127.0.0.1:{server.port}/2")
        seq = make_sequence(2)
        _write_all(good, seq)
        assert named.lookup(seq.blocks) == 2
        assert bad.lookup(seq.blocks) == 0
        assert _errors(bad, ErrorKind.CONNECTION) == 1
        assert "wrong" not in caplog.text and "s3cret" not in caplog.text
    finally:
        server.stop()


def test_a_password_from_the_environment_or_a_file_reaches_the_server(
    tmp_path, make_store, monkeypatch
):
    from pdserve.cli import build_parser
    from pdserve.engine.args import kv_store_config

    server = RedisServer(tmp_path, "--requirepass", "s3cret")
    url = f"redis://127.0.0.1:{server.port}/2"

    def config(*flags: str):
        return kv_store_config(build_parser().parse_args(["serve", "--kv-store", url, *flags]))

    try:
        monkeypatch.setenv(KV_STORE_PASSWORD_ENV, "s3cret")
        from_env = config()
        assert KV_STORE_PASSWORD_ENV not in os.environ  # taken: nothing started inherits it
        assert "s3cret" not in repr(from_env)
        (tmp_path / "password").write_text("s3cret\n")
        from_file = config("--kv-store-password-file", str(tmp_path / "password"))
        seq = make_sequence(2)
        _write_all(make_store(url, password=from_env.password), seq)
        assert make_store(url, password=from_file.password).lookup(seq.blocks) == 2
        assert make_store(url).lookup(seq.blocks) == 0  # no password: a counted miss
        (tmp_path / "empty").write_text("")
        with pytest.raises(ValueError, match=r"--kv-store-password-file.*empty"):
            config("--kv-store-password-file", str(tmp_path / "empty"))
        with pytest.raises(ValueError, match="give it once") as twice:
            make_store(f"redis://:pw-in-url@127.0.0.1:{server.port}/2", password="s3cret")
        assert "pw-in-url" not in str(twice.value)
    finally:
        server.stop()


# What docs/architecture.md tells an operator to give each tenant's workers (README: Use).
def acl_rules(namespace: str, password: str) -> list[str]:
    return [
        *("on", f">{password}", f"~pdserve:kv:{namespace}:*", "resetchannels"),
        *("-@all", "+@connection", "+exists", "+mget", "+set", "+del"),
    ]


def test_acl_users_hold_each_tenant_to_its_own_namespace(tmp_path, make_store):
    server = RedisServer(tmp_path)
    try:
        admin = server.client()
        for tenant in ("tenant-a", "tenant-b"):
            admin.execute_command("ACL", "SETUSER", tenant, *acl_rules(tenant, f"pw-{tenant}"))

        def worker(user: str, namespace: str) -> KVStore:
            return make_store(
                f"redis://{user}@127.0.0.1:{server.port}/0",
                namespace=namespace,
                password=f"pw-{user}",
                namespace_secret=f"secret-of-{namespace}",
            )

        a, b = worker("tenant-a", "tenant-a"), worker("tenant-b", "tenant-b")
        seq_a, seq_b = make_sequence(3, seed=1), make_sequence(3, seed=2)
        _write_all(a, seq_a)
        _write_all(b, seq_b)
        assert a.lookup(seq_a.blocks) == 3 and b.lookup(seq_b.blocks) == 3
        # The code's keys are the ones the ACL patterns name.
        keys = {key.decode() for key in admin.keys("*")}
        assert len(keys) == 6
        assert {key.split(":")[2] for key in keys} == {"tenant-a", "tenant-b"}
        # Tenant A's credentials cannot read or write B's blocks, even knowing B's namespace
        # and secret: refused by the server, a counted miss.
        intruder = worker("tenant-a", "tenant-b")
        assert intruder.keys.key(1) == b.keys.key(1)
        assert intruder.lookup(seq_b.blocks) == 0
        assert _errors(intruder, ErrorKind.SERVER) == 1
        sleep_past_backoff(intruder)
        assert intruder.write(seq_a.blocks, seq_a.cache_bytes, seq_a.block_ids) == 3
        intruder.flush()
        assert _errors(intruder, ErrorKind.SERVER) > 1  # the write refused too
        assert {key.decode() for key in admin.keys("*")} == keys  # nothing written in B's
        raw = redis.Redis(port=server.port, username="tenant-a", password="pw-tenant-a")
        b_key = next(k for k in keys if k.startswith("pdserve:kv:tenant-b:"))
        for forbidden in (lambda: raw.get(b_key), lambda: raw.set(b_key, b"x"), raw.scan):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
        raw.close()
        assert b.lookup(seq_b.blocks) == 3
    finally:
        server.stop()


def test_a_full_server_refuses_writes_but_still_serves_reads(tmp_path, make_store):
    server = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    try:
        store = make_store(server.url)
        seq = make_sequence(2)
        _write_all(store, seq)
        server.client().config_set("maxmemory", 1)  # full: every write is refused (OOM)
        more = make_sequence(3, seed=5)
        assert store.write(more.blocks, more.cache_bytes, more.block_ids) == 3
        assert store.flush()
        assert _errors(store, ErrorKind.SERVER) >= 1  # once per write batch
        assert store.metrics.value("pdserve:kv_store_dropped_writes_total") == 3
        assert store.is_available  # a server that answers is not backed off
        assert _fetch(store, seq)[0] == 2
    finally:
        server.stop()


def test_a_reader_waits_for_blocks_another_worker_is_still_writing(redis_server, make_store):
    writer, reader = make_store(redis_server.url), make_store(redis_server.url)
    seq = make_sequence(6)
    assert writer.write(seq.blocks[:3], seq.cache_bytes, seq.block_ids[:3]) == 3
    assert writer.flush()
    landed = threading.Event()
    put_many = writer.backend.put_many

    def put_late(items):  # the next values land only when the test says
        landed.wait(10)
        put_many(items)

    writer.backend.put_many = put_late
    assert writer.write(seq.blocks[3:], seq.cache_bytes, seq.block_ids[3:]) == 3
    # Blocks 3-5 are announced (in flight), not stored: the lookup counts them.
    wait_for = time.monotonic() + 10
    while reader.lookup(seq.blocks) < 6 and time.monotonic() < wait_for:
        time.sleep(0.01)
    assert reader.lookup(seq.blocks) == 6
    assert redis_server.client().exists(*reader.keys.keys(seq.blocks[3:])) == 0
    threading.Timer(0.1, landed.set).start()
    num_read, dest, dest_ids = _fetch(reader, seq)
    assert num_read == 6  # read as the writes landed, none computed
    assert blocks_equal(seq.cache, seq.block_ids, dest, dest_ids)
    assert _errors(reader, ErrorKind.EVICTED) == 0


# A writer that announces its blocks, then hangs before writing them, until killed.
_HANGING_WRITER = """
import sys, time
from pdserve.kv_store import KVStore, KVStoreConfig
from pdserve.kv_store.backend import Presence
from tests.kv_store.conftest import TINY, make_sequence

store = KVStore(KVStoreConfig(sys.argv[1], pending_write_wait_s=30.0), TINY)
store.backend.put_many = lambda items: time.sleep(3600)
seq = make_sequence(4)
store.write(seq.blocks, seq.cache_bytes, seq.block_ids)
keys = store.keys.keys(seq.blocks)
while store.backend.presence_many(keys) != [Presence.PENDING] * 4:
    time.sleep(0.01)
print("announced", flush=True)
time.sleep(3600)
"""


def test_a_write_that_never_lands_costs_the_bound_then_a_miss(redis_server, make_store):
    writer = subprocess.Popen(
        [sys.executable, "-c", _HANGING_WRITER, redis_server.url],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert writer.stdout.readline().strip() == "announced"
    finally:
        writer.kill()
        writer.wait()
    bound_s = 0.3
    reader = make_store(redis_server.url, pending_write_wait_s=bound_s)
    seq = make_sequence(4)
    assert reader.lookup(seq.blocks) == 4  # its markers outlive it (30 s)
    start = time.monotonic()
    num_read, _, _ = _fetch(reader, seq)
    waited = time.monotonic() - start
    assert num_read == 0
    assert bound_s <= waited < bound_s + 5.0
    assert _errors(reader, ErrorKind.EVICTED) == 1
    # The markers expire on their own: nothing of the dead writer stays in the store.
    client = redis_server.client()
    assert all(0 < client.pttl(key) <= 30_000 for key in client.keys("pdserve:kv:*"))
    assert client.exists(*reader.keys.keys(seq.blocks)) == 0


def test_an_error_reply_mid_read_is_a_miss_and_the_next_read_works(redis_server, make_store):
    store = make_store(redis_server.url)
    seq = make_sequence(4)
    _write_all(store, seq)
    raw = redis_server.client()
    key = store.keys.key(seq.blocks[1].block_hash)
    raw.delete(key)
    raw.rpush(key, b"not a value")  # GET answers WRONGTYPE between good values
    assert _fetch(store, seq)[0] == 0
    assert _errors(store, ErrorKind.SERVER) == 1
    raw.delete(key)
    _write_all(store, seq)
    num_read, dest, dest_ids = _fetch(store, seq)  # a fresh connection, replies in step
    assert num_read == 4
    assert blocks_equal(seq.cache, seq.block_ids, dest, dest_ids)
