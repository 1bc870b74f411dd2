"""KV-transfer bandwidth: shm and tcp (loopback) against a plain memcpy of the same bytes.

The prefill side runs in a separate (spawned) process, as in deployment; this process is the
decode side. Each transfer is timed twice: "data" is `fetch()` (the bytes landing in the local
cache) and "e2e" adds the RELEASE round trip that confirms them, i.e. what `receive()` costs.
The memcpy baseline is `torch.Tensor.copy_` between two contiguous tensors of the same byte
count in this process, timed right before each transfer; "x memcpy" is the median of those
paired ratios, so a busy machine skews both sides alike. "contiguous" cases lease consecutive
block ids on both sides; "fragmented" ones use shuffled ids (one copy per block, as after
prefix-cache churn).

With ``--sender-netns NS --sender-host ADDR`` (root; run this script itself inside another
namespace, e.g. ``ip netns exec B ...``) the prefill side moves into namespace NS and its KV
server binds ADDR there, so tcp crosses whatever link joins the two namespaces (a veth pair).

With ``--fleet-secret`` both sides hold a deployment's secret: tcp connections prove it and
seal every frame (the cost of authenticating the KV bytes). With ``--fleet-tls`` too, both
sides hold certificates of one CA made here and every connection is mutual TLS
(`--fleet-tls`: the cost of encrypting them).

    .venv/bin/python benchmarks/kv_transfer.py [--repeats 5] [--threads 1] [--json FILE]
        [--transports shm tcp] [--sender-netns NS --sender-host ADDR] [--fleet-secret]
        [--fleet-tls]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from pdserve.fleet import FleetCA, FleetTLS
from pdserve.kv_transfer import KVLayout, KVTransferConfig, KVTransferParams, plan_units
from pdserve.kv_transfer.connector import create_kv_transport


@dataclass(frozen=True)
class Case:
    name: str
    layout: KVLayout
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks_for(self.num_tokens)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes(self.num_blocks)


CASES = [
    Case(
        "SmolLM2-135M, 3,000 tokens",
        KVLayout("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64, 16, "bfloat16"),
        3000,
    ),
    Case(
        "Llama-3-8B layout, 1,024 tokens",
        KVLayout("meta-llama/Meta-Llama-3-8B", 32, 8, 128, 16, "bfloat16"),
        1024,
    ),
]
TRANSPORTS = ("shm", "tcp")
BLOCK_ORDERS = ("contiguous", "fragmented")
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Sender:
    """Where the prefill side runs: its network namespace (None: this one) and KV address."""

    transports: tuple[str, ...] = TRANSPORTS
    netns: str | None = None
    host: str = "127.0.0.1"
    secret: str | None = field(default=None, repr=False)
    tls: FleetTLS | None = field(default=None, repr=False)  # the prefill side's


def cache_blocks(case: Case) -> int:
    # Room for the lease at an offset, so block ids are not trivially 0..n-1.
    return 2 * case.num_blocks + 8


def block_ids(case: Case, order: str, seed: int) -> list[int]:
    ids = list(range(cache_blocks(case)))
    if order == "contiguous":
        return ids[5 : 5 + case.num_blocks]
    random.Random(seed).shuffle(ids)
    return ids[: case.num_blocks]


def enter_netns(name: str) -> None:
    """Move this thread (the sender's main thread, which opens the KV server's socket) into
    network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as ns:
        if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name!r} failed")


def sender_main(conn, threads: int, sender: Sender) -> None:
    """Prefill side: a producer per (case, transport), exposing leases on request."""
    torch.set_num_threads(threads)
    if sender.netns is not None:
        enter_netns(sender.netns)
    producers = {}
    for index, case in enumerate(CASES):
        for transport in sender.transports:
            config = KVTransferConfig(
                transport=transport,
                kv_role="kv_producer",
                kv_host=sender.host,
                secret=sender.secret,
                tls=sender.tls,
            )
            producer = create_kv_transport(config, case.layout, cache_blocks(case))
            producer.kv_cache.normal_()
            producers[index, transport] = producer
    conn.send("ready")
    while (command := conn.recv()) is not None:
        index, transport, request_id, ids = command
        producer = producers[index, transport]
        producer.collect()
        conn.send(producer.expose(request_id, ids, CASES[index].num_tokens).to_dict())
    for producer in producers.values():
        producer.close()


class Memcpy:
    """The baseline: `copy_` between two contiguous, already-faulted tensors of `nbytes`."""

    def __init__(self, nbytes: int) -> None:
        self._src = torch.ones(nbytes, dtype=torch.uint8)
        self._dst = torch.zeros(nbytes, dtype=torch.uint8)
        self._dst.copy_(self._src)

    def seconds(self) -> float:
        start = time.perf_counter()
        self._dst.copy_(self._src)
        return time.perf_counter() - start


@dataclass
class Samples:
    memcpy: list[float]
    data: list[float]
    e2e: list[float]


def time_transport(
    conn,
    index: int,
    case: Case,
    transport: str,
    order: str,
    repeats: int,
    memcpy: Memcpy,
    secret: str | None,
    tls: FleetTLS | None,
) -> Samples:
    config = KVTransferConfig(transport=transport, kv_role="kv_consumer", secret=secret, tls=tls)
    consumer = create_kv_transport(config, case.layout, cache_blocks(case))
    samples = Samples([], [], [])
    try:
        for attempt in range(repeats + 1):  # attempt 0 warms up: HELLO, mapping, page faults
            remote_ids = block_ids(case, order, seed=attempt)
            units = plan_units(
                case.layout.num_layers, remote_ids, block_ids(case, order, seed=attempt + 1000)
            )
            conn.send((index, transport, f"{transport}-{order}-{attempt}", remote_ids))
            params = KVTransferParams.from_dict(conn.recv())
            copy_seconds = memcpy.seconds()
            start = time.perf_counter()
            consumer.fetch(params, units)
            fetched = time.perf_counter()
            assert consumer.release(params), "lease ended during the benchmark"
            if attempt:
                samples.memcpy.append(copy_seconds)
                samples.data.append(fetched - start)
                samples.e2e.append(time.perf_counter() - start)
    finally:
        consumer.close()
    return samples


def row(
    case: Case, method: str, order: str, seconds: list[float], samples: Samples | None = None
) -> dict:
    result = {
        "case": case.name,
        "method": method,
        "blocks": order,
        "bytes": case.nbytes,
        "ms_median": 1e3 * statistics.median(seconds),
        "gbytes_per_s_median": case.nbytes / statistics.median(seconds) / 1e9,
        "gbytes_per_s_best": case.nbytes / min(seconds) / 1e9,
    }
    if samples is not None:
        result["data_ms_median"] = 1e3 * statistics.median(samples.data)
        result["data_gbytes_per_s_median"] = case.nbytes / statistics.median(samples.data) / 1e9
        result["vs_memcpy"] = _paired_ratio(samples.memcpy, samples.e2e)
        result["data_vs_memcpy"] = _paired_ratio(samples.memcpy, samples.data)
    return result


def _paired_ratio(memcpy: list[float], transfer: list[float]) -> float:
    return statistics.median(c / t for c, t in zip(memcpy, transfer, strict=True))


def run(
    repeats: int,
    threads: int,
    sender: Sender = Sender(),
    receiver_tls: FleetTLS | None = None,
) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=sender_main, args=(child, threads, sender), daemon=True)
    process.start()
    assert conn.recv() == "ready"
    results = []
    try:
        for index, case in enumerate(CASES):
            memcpy = Memcpy(case.nbytes)
            rows, copies = [], []
            for transport in sender.transports:
                for order in BLOCK_ORDERS:
                    samples = time_transport(
                        conn,
                        index,
                        case,
                        transport,
                        order,
                        repeats,
                        memcpy,
                        sender.secret,
                        receiver_tls,
                    )
                    copies += samples.memcpy
                    rows.append(row(case, transport, order, samples.e2e, samples))
            results += [row(case, "memcpy", "-", copies), *rows]
    finally:
        conn.send(None)
        process.join(timeout=30)
    return results


def print_table(results: list[dict]) -> None:
    header = (
        f"{'case':<32} {'method':<7} {'blocks':<11} {'MB':>6} {'ms e2e':>7} "
        f"{'ms data':>7} {'GB/s e2e':>8} {'GB/s data':>9} {'x memcpy e2e/data':>17}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        data_ms = f"{r['data_ms_median']:.2f}" if "vs_memcpy" in r else ""
        data_gbs = f"{r['data_gbytes_per_s_median']:.2f}" if "vs_memcpy" in r else ""
        ratio = f"{r['vs_memcpy']:.2f} / {r['data_vs_memcpy']:.2f}" if "vs_memcpy" in r else ""
        print(
            f"{r['case']:<32} {r['method']:<7} {r['blocks']:<11} {r['bytes'] / 1e6:>6.1f} "
            f"{r['ms_median']:>7.2f} {data_ms:>7} {r['gbytes_per_s_median']:>8.2f} "
            f"{data_gbs:>9} {ratio:>17}"
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (deployment: 1 per pinned worker)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument(
        "--sender-netns", default=None, help="run the prefill side in this network namespace (root)"
    )
    parser.add_argument(
        "--sender-host",
        default="127.0.0.1",
        help="address the prefill side's KV server binds and advertises",
    )
    parser.add_argument(
        "--fleet-secret", action="store_true", help="both sides hold a fleet secret (sealed tcp)"
    )
    parser.add_argument(
        "--fleet-tls", action="store_true", help="both sides hold certificates of one CA (TLS)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    secret = "kv-transfer-benchmark-secret" if args.fleet_secret else None
    ca = FleetCA() if args.fleet_tls else None
    sender = Sender(
        tuple(args.transports),
        args.sender_netns,
        args.sender_host,
        secret,
        ca.issue("prefill") if ca is not None else None,
    )
    receiver_tls = ca.issue("decode") if ca is not None else None
    results = run(args.repeats, args.threads, sender, receiver_tls)
    print_table(results)
    report = {
        "threads": args.threads,
        "repeats": args.repeats,
        "sender": {
            "transports": sender.transports,
            "netns": sender.netns,
            "host": sender.host,
            "fleet_secret": secret is not None,
            "fleet_tls": ca is not None,
        },
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
