"""Leases: released or expired leases end exactly once, never while being read, and
concurrent releases leak nothing."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.kv_transfer import KVLeaseError, LeaseManager


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


def test_release_ends_the_lease_once_at_collect(clock):
    leases = LeaseManager(lease_timeout=10, clock=clock)
    leases.grant("a", [1, 2])
    assert leases.collect() == []
    assert leases.release("a") is True
    assert leases.num_held_blocks == 2  # only collect() ends it, on the engine's thread
    assert leases.collect() == ["a"]
    assert leases.collect() == [] and leases.release("a") is False
    assert leases.num_held_blocks == 0


def test_timeout_frees_unfetched_blocks(clock):
    leases = LeaseManager(lease_timeout=10, clock=clock)
    leases.grant("a", [7])
    clock.now += 9.9
    assert leases.collect() == []
    clock.now += 0.2
    with pytest.raises(KVLeaseError, match="expired"), leases.reading("a"):
        pass
    assert leases.collect() == ["a"]


def test_release_after_expiry_reports_stale(clock):
    leases = LeaseManager(lease_timeout=10, clock=clock)
    leases.grant("a", [7])
    clock.now += 11
    assert leases.release("a") is False
    assert leases.collect() == ["a"]


def test_release_confirms_only_leased_blocks(clock):
    leases = LeaseManager(lease_timeout=10, clock=clock)
    leases.grant("a", [7, 8])
    leases.grant("b", [9])
    assert leases.release("a", [8, 7]) is True
    assert leases.release("b", [9, 10]) is False  # read a block it was never given
    assert sorted(leases.collect()) == ["a", "b"]


def test_blocks_being_read_are_not_freed_even_when_expired(clock):
    leases = LeaseManager(lease_timeout=10, clock=clock)
    leases.grant("a", [7])
    with leases.reading("a"):
        clock.now += 11
        leases.release("a")
        assert leases.collect() == []
    assert leases.collect() == ["a"]


def test_refusals_name_the_reason(clock):
    leases = LeaseManager(lease_timeout=10, clock=clock)
    with pytest.raises(KVLeaseError, match="unknown"), leases.reading("nope"):
        pass
    leases.grant("a", [1])
    with pytest.raises(ValueError, match="already holds"):
        leases.grant("a", [2])
    leases.release("a")
    with pytest.raises(KVLeaseError, match="already released"), leases.reading("a"):
        pass


def test_concurrent_releases_and_collects_leak_nothing():
    leases = LeaseManager(lease_timeout=60)
    num_requests = 400
    for i in range(num_requests):
        leases.grant(f"r{i}", [2 * i, 2 * i + 1])
    collected: list[str] = []

    def receiver(offset: int) -> None:
        for i in range(offset, num_requests, 4):
            with leases.reading(f"r{i}"):
                pass
            assert leases.release(f"r{i}") is True

    threads = [threading.Thread(target=receiver, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        collected += leases.collect()
    collected += leases.collect()
    assert sorted(collected) == sorted(f"r{i}" for i in range(num_requests))
    assert leases.num_held_blocks == 0


def test_real_clock_expiry():
    leases = LeaseManager(lease_timeout=0.05)
    leases.grant("a", [1])
    deadline = time.monotonic() + 5
    while not (collected := leases.collect()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert collected == ["a"]


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="kv_lease_timeout"):
        LeaseManager(lease_timeout=0)
