"""Two network namespaces joined by a veth pair: two hosts on one machine (needs root + ip)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET_PREFIX = "10.200.0"


@dataclass(frozen=True)
class TwoHosts:
    ns_a: str
    ns_b: str
    addr_a: str
    addr_b: str
    veth_b: str  # host B's end of the pair
    veth_a: str  # host A's end

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside namespace `ns`."""
        return ["ip", "netns", "exec", ns, *argv]

    def is_http_ok(self, ns: str, url: str) -> bool:
        """Whether GET `url` from inside `ns` answers 200."""
        probe = (
            "import httpx, sys\ntry:\n  r = httpx.get(sys.argv[1], trust_env=False)\n"
            "except httpx.HTTPError:\n  sys.exit(1)\nsys.exit(r.status_code != 200)"
        )
        return (
            subprocess.run(
                self.command(ns, [sys.executable, "-c", probe, url]), capture_output=True
            ).returncode
            == 0
        )

    def post_json(self, ns: str, url: str, body: dict) -> dict:
        """POST `body` from inside `ns`: {"status", "body", "timing"} (the x-pdserve-timing
        header, parsed)."""
        code = (
            "import httpx, json, sys\n"
            "r = httpx.post(sys.argv[1], json=json.loads(sys.argv[2]), trust_env=False, "
            "timeout=600)\n"
            "print(json.dumps({'status': r.status_code, 'body': r.json(), "
            "'timing': json.loads(r.headers.get('x-pdserve-timing', 'null'))}))"
        )
        out = subprocess.run(
            self.command(ns, [sys.executable, "-c", code, url, json.dumps(body)]),
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
        )
        return json.loads(out.stdout)

    def rx_bytes_b(self) -> int:
        """Bytes host B has received over the veth."""
        path = f"/sys/class/net/{self.veth_b}/statistics/rx_bytes"
        out = subprocess.run(
            self.command(self.ns_b, ["cat", path]), capture_output=True, text=True, check=True
        )
        return int(out.stdout)


def rate_bits_per_s(rate: str) -> float:
    """A tc rate ("10gbit", "100mbit", "123456bit") in bits per second."""
    match = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate)
    if match is None:
        raise ValueError(f"rate {rate!r}: expected e.g. 10gbit, 100mbit")
    return float(match[1]) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def shape_link(hosts: TwoHosts, rate: str) -> None:
    """Both ends of the veth limited to `rate` (tc's units, e.g. 10gbit, 250mbit) by a token
    bucket (tbf; netem is not in every kernel) with a burst of 4 ms of it, at least 64 KB."""
    burst = max(64 * 1024, int(rate_bits_per_s(rate) / 8 * 0.004))
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
    for ns, dev in ((hosts.ns_a, hosts.veth_a), (hosts.ns_b, hosts.veth_b)):
        subprocess.run(
            hosts.command(ns, ["tc", "qdisc", "replace", "dev", dev, "root", *tbf]),
            check=True,
            capture_output=True,
        )


def netns_unavailable_reason() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    probe = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    tag = str(os.getpid())[-6:]
    hosts = TwoHosts(
        f"pda{tag}", f"pdb{tag}", f"{SUBNET_PREFIX}.1", f"{SUBNET_PREFIX}.2", f"vb{tag}", f"va{tag}"
    )
    veth_a = hosts.veth_a
    try:
        for argv in (
            ["ip", "netns", "add", hosts.ns_a],
            ["ip", "netns", "add", hosts.ns_b],
            ["ip", "link", "add", veth_a, "type", "veth", "peer", "name", hosts.veth_b],
            ["ip", "link", "set", veth_a, "netns", hosts.ns_a],
            ["ip", "link", "set", hosts.veth_b, "netns", hosts.ns_b],
        ):
            subprocess.run(argv, check=True, capture_output=True)
        for ns, dev, addr in (
            (hosts.ns_a, veth_a, hosts.addr_a),
            (hosts.ns_b, hosts.veth_b, hosts.addr_b),
        ):
            for argv in (
                ["ip", "addr", "add", f"{addr}/24", "dev", dev],
                ["ip", "link", "set", dev, "up"],
                ["ip", "link", "set", "lo", "up"],
            ):
                subprocess.run(hosts.command(ns, argv), check=True, capture_output=True)
        yield hosts
    finally:
        for ns in (hosts.ns_a, hosts.ns_b):  # deleting a namespace removes its veth end
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
