"""A TCP relay for tests that watch or alter what crosses the wire between two processes: every
byte both ways is recorded, and the upstream-to-client direction can be passed through a
tamperer (`FlipDataPayloads`: a man in the middle of a KV connection)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from pdserve.kv_transfer.wire import HEADER, TAG_BYTES, MessageType

Tamper = Callable[[bytes], bytes]


class TcpRelay:
    """Listens on (`host`, `port`: 0 for any) and pipes each connection to `target`.

    `sent` / `answered`: every byte relayed toward `target` / back from it, all connections
    (`captured`: both). `new_tamperer`, when set, makes one tamperer per connection for the
    bytes coming back from `target`."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self._target = target
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self.sent = bytearray()
        self.answered = bytearray()
        self.new_tamperer: Callable[[], Tamper] | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def captured(self) -> bytes:
        with self._lock:
            return bytes(self.sent + self.answered)

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            tamper = self.new_tamperer() if self.new_tamperer is not None else None
            with self._lock:
                self._sockets += [client, upstream]
            for args in (
                (client, upstream, None, self.sent),
                (upstream, client, tamper, self.answered),
            ):
                threading.Thread(target=self._pipe, args=args, daemon=True).start()

    def _pipe(
        self,
        source: socket.socket,
        sink: socket.socket,
        tamper: Tamper | None,
        record: bytearray,
    ) -> None:
        try:
            while chunk := source.recv(1 << 16):
                with self._lock:
                    record += chunk
                sink.sendall(tamper(chunk) if tamper is not None else chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def drop_connections(self) -> None:
        """Cut every relayed connection (both ends see it closed)."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self.drop_connections()


class FlipDataPayloads:
    """Follows a KV server's side of a sealed connection frame by frame (the CHALLENGE in
    clear, a tag after every later frame) and flips one bit of the first payload byte of
    every DATA frame."""

    def __init__(self) -> None:
        self._header = bytearray()  # the next frame's header, as far as it came
        # The rest of the current frame: (number of bytes, flip the first of them?) parts.
        self._parts: list[list] = []
        self._is_sealed = False
        self.num_flipped = 0

    def __call__(self, chunk: bytes) -> bytes:
        out = bytearray()
        data = memoryview(chunk)
        while data:
            if not self._parts:
                take = min(HEADER.size - len(self._header), len(data))
                self._header += data[:take]
                out += data[:take]
                data = data[take:]
                if len(self._header) == HEADER.size:
                    self._start_frame()
                continue
            part = self._parts[0]
            take = min(part[0], len(data))
            piece = bytearray(data[:take])
            if part[1]:
                piece[0] ^= 0x01
                part[1] = False
                self.num_flipped += 1
            out += piece
            data = data[take:]
            part[0] -= take
            if not part[0]:
                self._parts.pop(0)
        return bytes(out)

    def _start_frame(self) -> None:
        _, _, msg_type, meta_len, payload_len = HEADER.unpack(bytes(self._header))
        self._header.clear()
        tag = TAG_BYTES if self._is_sealed else 0
        self._is_sealed = True  # every frame after the first (the CHALLENGE) is sealed
        is_data = msg_type == MessageType.DATA and payload_len > 0
        parts = [[meta_len, False], [payload_len, is_data], [tag, False]]
        self._parts = [part for part in parts if part[0]]
