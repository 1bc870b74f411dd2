"""`RedisServer`: a private `redis-server` process on a free loopback port, for tests,
benchmarks and one-host trials (`redis-server` from the Debian package of that name).

No persistence (a restart comes back empty, as after a crash without AOF) and DEBUG allowed
from loopback (tests freeze it with DEBUG SLEEP to play a slow server).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from pdserve.ports import free_port

START_TIMEOUT_S = 10.0


def find_redis_server() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """Started on construction; `kill()` + `start()` restarts it empty on the same port."""

    def __init__(self, work_dir: Path, *extra_args: str, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise FileNotFoundError(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        self.port = free_port()
        self.work_dir = Path(work_dir)
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.work_dir)]
        command += ["--enable-debug-command", "local", *self.extra_args]
        with open(self.work_dir / f"redis-{self.port}.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers_ping():
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def _answers_ping(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"redis-server exited with {self.process.returncode}; see {self.work_dir}"
            )
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False
