"""Keys and values: deterministic across processes, salted by everything a block's bytes
depend on, and a value is only ever accepted for exactly the block it was written for."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kv_store import BlockRef, ErrorKind, KVStoreConfig
from pdserve.kv_store.codec import HEADER, decode_block, encode_block
from pdserve.kv_store.errors import ValueRejected
from pdserve.kv_store.keys import KeyScheme
from tests.kv_store.conftest import REPO_ROOT, TINY

BLOCK = BlockRef(0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321, (1, 2, 3, 4))
PAYLOAD = bytes(range(256)) * 4  # TINY.payload_nbytes
DIGEST = TINY.digest()


def _key_in_fresh_process(seed: str) -> str:
    code = (
        "from pdserve.core.block_manager import extend_block_hashes\n"
        "from pdserve.kv_store.keys import KeyScheme\n"
        "from tests.kv_store.conftest import TINY\n"
        "h = extend_block_hashes([], list(range(12)), 4)\n"
        "print(KeyScheme(TINY, 'ns').key(h[-1]).decode())"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, check=True
    )
    return result.stdout.decode().strip()


def test_keys_are_the_same_in_every_process():
    # Python's hash() differs per process; the store's keys must not.
    assert _key_in_fresh_process("1") == _key_in_fresh_process("2")


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"dtype": "bfloat16"},
        {"kv_dtype": "float16"},
        {"quantization": "Q8_0"},
        {"block_size": 8},
        {"num_layers": 3},
        {"num_kv_heads": 1},
        {"head_dim": 16},
    ],
)
def test_every_layout_field_salts_the_key(change):
    other = dataclasses.replace(TINY, **change)
    assert other.digest() != TINY.digest()
    assert KeyScheme(other).key(1) != KeyScheme(TINY).key(1)


def test_namespace_salts_the_key():
    keys = {KeyScheme(TINY, ns).key(1) for ns in ("", "a", "b", "ab")}
    assert len(keys) == 4
    assert KeyScheme(TINY, "a").key(1) == KeyScheme(TINY, "a").key(1)
    assert b"tenant" not in KeyScheme(TINY, "tenant").key(1)  # the name itself is not exposed


def test_value_round_trip():
    value = encode_block(DIGEST, BLOCK, PAYLOAD)
    assert len(value) == HEADER.size + 16 + len(PAYLOAD)
    assert bytes(decode_block(value, DIGEST, BLOCK, len(PAYLOAD))) == PAYLOAD


@pytest.mark.parametrize(
    ("expected", "kind"),
    [
        (dataclasses.replace(BLOCK, token_ids=(1, 2, 3, 5)), ErrorKind.MISMATCH),
        (dataclasses.replace(BLOCK, parent_hash=None), ErrorKind.MISMATCH),
        (dataclasses.replace(BLOCK, block_hash=7), ErrorKind.MISMATCH),
        (dataclasses.replace(BLOCK, token_ids=(1, 2, 3, 4, 5)), ErrorKind.CORRUPT),
    ],
)
def test_a_value_is_only_accepted_for_its_block(expected, kind):
    value = encode_block(DIGEST, BLOCK, PAYLOAD)
    with pytest.raises(ValueRejected) as caught:
        decode_block(value, DIGEST, expected, len(PAYLOAD))
    assert caught.value.kind is kind


def test_every_single_byte_change_is_rejected():
    value = encode_block(DIGEST, BLOCK, PAYLOAD)
    for i in range(0, len(value), 7):
        damaged = bytearray(value)
        damaged[i] ^= 0x40
        with pytest.raises(ValueRejected):
            decode_block(bytes(damaged), DIGEST, BLOCK, len(PAYLOAD))


def test_foreign_and_truncated_values_are_rejected_by_kind():
    value = encode_block(b"\x01" * 16, BLOCK, PAYLOAD)
    with pytest.raises(ValueRejected) as caught:
        decode_block(value, DIGEST, BLOCK, len(PAYLOAD))
    assert caught.value.kind is ErrorKind.FOREIGN
    good = encode_block(DIGEST, BLOCK, PAYLOAD)
    for cut in (0, HEADER.size - 1, HEADER.size + 10, len(good) - 1):
        with pytest.raises(ValueRejected) as caught:
            decode_block(good[:cut], DIGEST, BLOCK, len(PAYLOAD))
        assert caught.value.kind is ErrorKind.TRUNCATED


@given(st.binary(max_size=2000))
def test_arbitrary_bytes_never_decode(data):
    with pytest.raises(ValueRejected):
        decode_block(data, DIGEST, BLOCK, len(PAYLOAD))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "--kv-store must be"),
        ("http://host:6379", "--kv-store must be"),
        ("local:", "needs a directory"),
    ],
)
def test_bad_urls_name_the_flag(url, message):
    with pytest.raises(ValueError, match=message):
        KVStoreConfig(url)


def test_limits_name_their_flags():
    with pytest.raises(ValueError, match="--kv-store-max-gb"):
        KVStoreConfig("local", max_gb=0)
    with pytest.raises(ValueError, match="--kv-store-namespace"):
        KVStoreConfig("local", namespace="x" * 200)


def test_passwords_never_reach_messages():
    config = KVStoreConfig("rediss://alice:hunter2@cache.internal:6380/1")
    assert config.redacted_url == "rediss://alice:***@cache.internal:6380/1"
    assert KVStoreConfig("redis://:pw@h/0").redacted_url == "redis://:***@h/0"
    assert "pw2" not in KVStoreConfig("unix:///run/redis.sock?password=pw2&db=1").redacted_url
    with pytest.raises(ValueError) as caught:
        KVStoreConfig("ftp://bob:hunter2@host")
    assert "hunter2" not in str(caught.value)


def test_local_urls():
    assert KVStoreConfig("local").local_dir in ("/dev/shm", __import__("tempfile").gettempdir())
    assert KVStoreConfig("local:/var/cache/pdserve").local_dir == "/var/cache/pdserve"


def test_model_identity_follows_the_weights_not_the_path(tmp_path):
    from pdserve.kv_store.keys import model_identity

    weights = bytes(range(256)) * 40_000  # 10 MB
    for folder in ("a", "b", "tuned"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "a" / "model.safetensors").write_bytes(weights)
    (tmp_path / "b" / "model.safetensors").write_bytes(weights)
    tuned = bytearray(weights)
    tuned[5_000_000 : 5_000_000 + 200_000] = b"\x07" * 200_000  # a fine-tuned stretch
    (tmp_path / "tuned" / "model.safetensors").write_bytes(tuned)
    ids = {d: model_identity("m", tmp_path / d) for d in ("a", "b", "tuned")}
    assert ids["a"] == ids["b"]  # the same checkpoint copied elsewhere shares blocks
    assert ids["tuned"] != ids["a"]
    assert model_identity("other-name", tmp_path / "a") != ids["a"]
    (tmp_path / "single.gguf").write_bytes(weights)
    assert model_identity("m", tmp_path / "single.gguf").startswith("m@")


def test_a_registered_backend_is_named_by_its_url_scheme(tmp_path):
    """A new backend is a `KVStoreBackend` and one `register_backend`: its scheme is a valid
    --kv-store URL, and the store builds it (its module loaded only then)."""
    from pdserve.kv_store import config as store_config
    from pdserve.kv_store.backend import create_backend

    with pytest.raises(ValueError, match="redis://, rediss://, unix://; got 'memo://x'"):
        KVStoreConfig("memo://x")
    store_config.register_backend("memo", "tests.kv_store.memo_backend", "MemoBackend")
    try:
        with pytest.raises(ValueError, match="registered already"):
            store_config.register_backend("memo", "tests.kv_store.memo_backend", "MemoBackend")
        backend = create_backend(KVStoreConfig("memo://x"), "salt", 64)
        backend.put_many([(b"k", b"v")])
        assert backend.get_many([b"k", b"j"]) == [b"v", None]
    finally:
        del store_config._BACKENDS["memo"]
