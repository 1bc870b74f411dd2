"""The embedded `local` store: one shared segment per layout that separate processes open,
an LRU bounded by --kv-store-max-gb, values checked like any backend's."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from pdserve.kv_store import ErrorKind
from pdserve.kv_store.local_backend import segment_path
from tests.kv_store.conftest import REPO_ROOT, TINY, blocks_equal, empty_cache, make_sequence

_WRITER = """
import sys
from pdserve.kv_store import KVStore, KVStoreConfig
from tests.kv_store.conftest import TINY, make_sequence
url, seed, num_blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = KVStore(KVStoreConfig(url, max_gb=0.001), TINY)
seq = make_sequence(num_blocks, seed=seed, first_token=seed)
for block, block_id in zip(seq.blocks, seq.block_ids):  # one at a time: interleave
    assert store.write([block], seq.cache_bytes, [block_id]) == 1
    assert store.flush()
store.close()
"""


def _fetch(store, seq):
    dest = empty_cache()
    ids = list(range(len(seq.blocks)))
    return store.fetch(seq.blocks, dest.view(np.uint8).reshape(4, 64, -1), ids), dest, ids


def _writers(url: str, seeds: list[int], num_blocks: int) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, url, str(s), str(num_blocks)], cwd=REPO_ROOT
        )
        for s in seeds
    ]
    assert [p.wait(60) for p in processes] == [0] * len(seeds)


def test_round_trip_and_segment_is_private(tmp_path, make_store):
    store = make_store(f"local:{tmp_path}")
    seq = make_sequence(5)
    assert store.write(seq.blocks, seq.cache_bytes, seq.block_ids) == 5
    assert store.flush()
    assert store.lookup(seq.blocks) == 5
    num_read, dest, ids = _fetch(store, seq)
    assert num_read == 5
    assert blocks_equal(seq.cache, seq.block_ids, dest, ids)
    path = segment_path(str(tmp_path), store.keys.salt)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # blocks are prompts: owner only


def test_two_processes_share_one_store(tmp_path, make_store):
    url = f"local:{tmp_path}"
    # Two writer processes at once, each its own prompt, block by block.
    _writers(url, [1, 2], 12)
    reader = make_store(url, max_gb=0.001)
    for seed in (1, 2):
        seq = make_sequence(12, seed=seed, first_token=seed)
        assert reader.lookup(seq.blocks) == 12
        num_read, dest, ids = _fetch(reader, seq)
        assert num_read == 12
        assert blocks_equal(seq.cache, seq.block_ids, dest, ids)
    assert reader.metrics.value("pdserve:kv_store_errors_total", kind="corrupt") == 0


def test_capacity_evicts_least_recently_used(tmp_path, make_store):
    store = make_store(f"local:{tmp_path}", max_gb=4 * 1088 / 2**30)
    assert store.value_nbytes == 1088
    assert store.backend.num_slots == 4
    seq = make_sequence(5)

    def write(i: int) -> None:
        store.write([seq.blocks[i]], seq.cache_bytes, [seq.block_ids[i]])
        assert store.flush()

    for i in range(4):
        write(i)
    assert _fetch_one(store, seq, 0)  # block 0 read: now block 1 is the least recent
    write(4)
    present = [store.lookup([b]) for b in seq.blocks]
    assert present == [1, 0, 1, 1, 1]


def _fetch_one(store, seq, i: int) -> bool:
    dest = empty_cache()
    return store.fetch([seq.blocks[i]], dest.view(np.uint8).reshape(4, 64, -1), [0]) == 1


def test_garbage_in_a_slot_is_a_counted_miss(tmp_path, make_store):
    store = make_store(f"local:{tmp_path}")
    seq = make_sequence(3)
    store.write(seq.blocks, seq.cache_bytes, seq.block_ids)
    assert store.flush()
    store.backend.put_many([(store.keys.key(seq.blocks[1].block_hash), b"not a block" * 90)])
    assert _fetch(store, seq)[0] == 1
    assert store.metrics.value("pdserve:kv_store_errors_total", kind=ErrorKind.CORRUPT.value) == 1


def test_a_segment_of_another_format_is_replaced(tmp_path, make_store):
    first = make_store(f"local:{tmp_path}")
    path = segment_path(str(tmp_path), first.keys.salt)
    first.close()
    with open(path, "r+b") as segment:
        segment.write(b"\xff" * 64)  # not our magic
    store = make_store(f"local:{tmp_path}")
    seq = make_sequence(2)
    store.write(seq.blocks, seq.cache_bytes, seq.block_ids)
    assert store.flush()
    assert store.lookup(seq.blocks) == 2


def test_fingerprints_and_namespaces_get_their_own_segments(tmp_path, make_store):
    from dataclasses import replace

    stores = [
        make_store(f"local:{tmp_path}"),
        make_store(f"local:{tmp_path}", namespace="other"),
        make_store(f"local:{tmp_path}", fingerprint=replace(TINY, model_id="another-model")),
    ]
    assert len({s.backend.path for s in stores}) == 3


def _planted(tmp_path, make_store) -> str:
    """The path a store's segment takes, with a valid segment left there and the store gone."""
    store = make_store(f"local:{tmp_path}")
    path = segment_path(str(tmp_path), store.keys.salt)
    store.close()
    return path


def test_a_segment_others_can_read_or_write_is_refused(tmp_path, make_store):
    path = _planted(tmp_path, make_store)
    for mode in (0o666, 0o640, 0o602):
        os.chmod(path, mode)
        with pytest.raises(PermissionError) as refused:
            make_store(f"local:{tmp_path}")
        message = str(refused.value)
        assert path in message and f"{mode:04o}" in message and "owned by" in message
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o602  # refused, not repaired or replaced


def test_a_symlink_in_the_segments_place_is_refused_and_its_target_untouched(tmp_path, make_store):
    path = _planted(tmp_path, make_store)
    target = tmp_path / "elsewhere"
    os.rename(path, target)
    os.symlink(target, path)
    before = target.read_bytes()
    with pytest.raises(PermissionError, match="symbolic link") as refused:
        make_store(f"local:{tmp_path}")
    assert path in str(refused.value)
    assert target.read_bytes() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_segment_owned_by_another_user_is_refused(tmp_path, make_store):
    path = _planted(tmp_path, make_store)
    os.chown(path, 65534, 65534)  # nobody, mode still 0600
    with pytest.raises(PermissionError, match=r"owned by (nobody \()?uid 65534") as refused:
        make_store(f"local:{tmp_path}")
    assert path in str(refused.value) and "0600" in str(refused.value)
