"""`pdserve.ports`: ports drawn free and below the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from pdserve import ports
from pdserve.ports import free_port, free_port_block


def test_free_port_is_free_and_below_the_ephemeral_range():
    low = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert ports.LOWEST_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if someone holds it


def test_free_port_block_skips_a_block_someone_holds(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The first draw lands on the held port's block; the draw must move on. Later draws
        # are random: a fixed one inside the ephemeral range (where `taken` lies) may be some
        # connection's port, in use or in TIME_WAIT (a CI run lost this test so).
        draw, draws = ports.random.Random.randrange, []

        def held_block_first(self, start, stop):
            draws.append(taken - 1 if not draws else draw(self, start, stop))
            return draws[-1]

        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(ports.random.Random, "randrange", held_block_first)
        base = free_port_block(3)
        assert len(draws) >= 2 and base == draws[-1] and not base <= taken < base + 3


def test_free_port_block_says_when_none_is_free(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: taken)
        with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
            free_port_block(2)
