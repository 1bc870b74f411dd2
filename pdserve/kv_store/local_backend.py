"""`LocalBackend`: the embedded store every pdserve process on one host opens; no server.

One segment file per namespace and layout (``pdserve-kvstore-<salt>`` in shared memory, or
in the directory of ``--kv-store local:DIR``), mapped by every process that uses it::

    header  8 x u64   magic, segment version, slot_bytes, num_slots, clock, num_allocated
    keys    num_slots x u64   BLAKE2b-64 of the store key; 0 = empty slot
    stamps  num_slots x u64   clock at the slot's last write or read (LRU order)
    lens    num_slots x u64   bytes of the slot's value
    data    num_slots x slot_bytes, from a page boundary

Invariants: every access holds the segment's `flock` (released by the kernel if a process
dies, so a crash never wedges the others) and, within a process, a thread lock. A slot being
written has key 0 until its bytes are complete, so a writer killed mid-copy leaves an empty
slot, never a half value. Slots are used in order up to `num_allocated` (their pages are
reserved with `posix_fallocate` first, so a full /dev/shm is a failed write, not a SIGBUS);
after that a write reuses the least recently used slot. Values only ever fill whole slots of
one size, because one segment holds one layout's blocks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from pdserve.kv_store.backend import KVStoreBackend
from pdserve.kv_store.config import KVStoreConfig
from pdserve.kv_store.errors import ErrorKind, StoreUnavailable

logger = logging.getLogger(__name__)

_MAGIC = int.from_bytes(b"PDKSLOC\x01", "little")
_SEGMENT_VERSION = 1
_HEADER_WORDS = 8
_MAGIC_I, _VERSION_I, _SLOT_BYTES_I, _NUM_SLOTS_I, _CLOCK_I, _NUM_ALLOCATED_I = range(6)
_PAGE = 4096


def segment_path(directory: str, salt: str) -> str:
    return os.path.join(directory, f"pdserve-kvstore-{salt}")


def _key_id(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") or 1


class LocalBackend(KVStoreBackend):
    name = "local"

    @classmethod
    def from_config(cls, config: KVStoreConfig, salt: str, value_nbytes: int) -> LocalBackend:
        return cls(config.local_dir, salt, value_nbytes, config.max_gb)

    def __init__(self, directory: str, salt: str, slot_bytes: int, max_gb: float) -> None:
        self.path = segment_path(directory, salt)
        num_slots = max(int(max_gb * 2**30) // slot_bytes, 1)
        self._thread_lock = threading.Lock()
        self._fd = _open_segment(self.path, slot_bytes, num_slots)
        header = os.pread(self._fd, 8 * _HEADER_WORDS, 0)
        self.num_slots = int(np.frombuffer(header, "<u8")[_NUM_SLOTS_I])
        self.slot_bytes = slot_bytes
        self._data_offset = _data_offset(self.num_slots)
        self._mmap = mmap.mmap(self._fd, self._data_offset + self.num_slots * slot_bytes)
        n = self.num_slots
        self._header = np.frombuffer(self._mmap, "<u8", _HEADER_WORDS, 0)
        self._keys = np.frombuffer(self._mmap, "<u8", n, 8 * _HEADER_WORDS)
        self._stamps = np.frombuffer(self._mmap, "<u8", n, 8 * (_HEADER_WORDS + n))
        self._lens = np.frombuffer(self._mmap, "<u8", n, 8 * (_HEADER_WORDS + 2 * n))
        # Where this process last saw each key: a hint, checked under the lock before use.
        self._hints: dict[int, int] = {}

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    # ---- KVStoreBackend ----------------------------------------------------------------
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        ids = np.array([_key_id(k) for k in keys], dtype="<u8")
        with self._locked():
            present = np.isin(ids, self._keys[: self._num_allocated])
        return present.tolist()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            key_id = _key_id(key)
            with self._locked():
                slot = self._find(key_id)
                if slot is None:
                    values.append(None)
                    continue
                self._stamps[slot] = self._tick()
                start = self._data_offset + slot * self.slot_bytes
                values.append(self._mmap[start : start + int(self._lens[slot])])
        return values

    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray]]) -> None:
        for key, value in items:
            if len(value) > self.slot_bytes:
                raise StoreUnavailable(
                    ErrorKind.FULL, f"{len(value)} bytes exceed the {self.slot_bytes}-byte slot"
                )
            key_id = _key_id(key)
            with self._locked():
                slot = self._find(key_id)
                if slot is None:
                    slot = self._free_slot()
                self._keys[slot] = 0  # invisible until complete
                start = self._data_offset + slot * self.slot_bytes
                self._mmap[start : start + len(value)] = value
                self._lens[slot] = len(value)
                self._stamps[slot] = self._tick()
                self._keys[slot] = key_id
                self._remember(key_id, slot)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            with self._locked():
                slot = self._find(_key_id(key))
                if slot is not None:
                    self._keys[slot] = 0

    def close(self) -> None:
        with self._thread_lock:
            if self._fd < 0:
                return
            # numpy views pin the mapping: drop them before unmapping.
            del self._header, self._keys, self._stamps, self._lens
            self._mmap.close()
            os.close(self._fd)
            self._fd = -1

    # ---- internals (call with the lock held) -------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            if self._fd < 0:
                raise StoreUnavailable(ErrorKind.CONNECTION, "the local KV store is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def _num_allocated(self) -> int:
        return int(self._header[_NUM_ALLOCATED_I])

    def _tick(self) -> int:
        self._header[_CLOCK_I] += 1
        return int(self._header[_CLOCK_I])

    def _find(self, key_id: int) -> int | None:
        slot = self._hints.get(key_id)
        if slot is not None and self._keys[slot] == key_id:
            return slot
        found = np.flatnonzero(self._keys[: self._num_allocated] == key_id)
        if not len(found):
            self._hints.pop(key_id, None)
            return None
        self._remember(key_id, int(found[0]))
        return int(found[0])

    def _remember(self, key_id: int, slot: int) -> None:
        if len(self._hints) > 2 * self.num_slots:  # keep the hints bounded
            self._hints.clear()
        self._hints[key_id] = slot

    def _free_slot(self) -> int:
        """An empty slot, else a never-used one (its pages reserved), else the least
        recently used one."""
        num_allocated = self._num_allocated
        empty = np.flatnonzero(self._keys[:num_allocated] == 0)
        if len(empty):
            return int(empty[0])
        if num_allocated < self.num_slots:
            try:
                os.posix_fallocate(
                    self._fd, self._data_offset + num_allocated * self.slot_bytes, self.slot_bytes
                )
            except OSError as exc:
                if num_allocated == 0 or exc.errno != errno.ENOSPC:
                    raise StoreUnavailable(ErrorKind.FULL, f"{self.path}: {exc}") from None
                # The file system is full before the segment: recycle what it has.
                return int(np.argmin(self._stamps[:num_allocated]))
            self._header[_NUM_ALLOCATED_I] = num_allocated + 1
            return num_allocated
        return int(np.argmin(self._stamps))


def _data_offset(num_slots: int) -> int:
    return -(-8 * (_HEADER_WORDS + 3 * num_slots) // _PAGE) * _PAGE


def _open_segment(path: str, slot_bytes: int, num_slots: int) -> int:
    """Open the segment at `path`, creating it (atomically: initialised under a temporary
    name, then linked into place) or replacing one of another slot size or version."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = _create_segment(path, slot_bytes, num_slots)
            if fd is not None:
                return fd
            continue  # another process created it first: open theirs
        header = np.frombuffer(os.pread(fd, 8 * _HEADER_WORDS, 0), "<u8")
        if (
            len(header) == _HEADER_WORDS
            and header[_MAGIC_I] == _MAGIC
            and header[_VERSION_I] == _SEGMENT_VERSION
            and header[_SLOT_BYTES_I] == slot_bytes
        ):
            if header[_NUM_SLOTS_I] != num_slots:
                logger.info(
                    "local KV store %s holds %d slots (sized by the process that created it)",
                    path,
                    header[_NUM_SLOTS_I],
                )
            return fd
        logger.warning("replacing local KV store %s: another version or slot size", path)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        os.close(fd)
    raise StoreUnavailable(ErrorKind.CONNECTION, f"cannot open the local KV store {path}")


def _create_segment(path: str, slot_bytes: int, num_slots: int) -> int | None:
    """A new initialised segment linked at `path`, or None if another process won."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    # 0600: a stored block is a user's prompt in another form; only this user reads it.
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, _data_offset(num_slots) + num_slots * slot_bytes)  # sparse
        header = np.zeros(_HEADER_WORDS, "<u8")
        header[[_MAGIC_I, _VERSION_I, _SLOT_BYTES_I, _NUM_SLOTS_I]] = (
            _MAGIC,
            _SEGMENT_VERSION,
            slot_bytes,
            num_slots,
        )
        os.pwrite(fd, header.tobytes(), 0)
        os.link(tmp, path)
    except FileExistsError:
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        raise StoreUnavailable(
            ErrorKind.FULL, f"cannot create the local KV store {path}: {exc}"
        ) from None
    finally:
        os.unlink(tmp)
    return fd
