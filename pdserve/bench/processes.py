"""What a running deployment's processes hold, read from outside (Linux `/proc` and the
workers' `/metrics`): for the soak benchmark and the tests that check nothing leaked.

A launcher's workers are its child processes, each told apart by its ``--port``
(`worker_pid`); a worker's KV blocks held are its pool's total less its free ones (cached but
free blocks count as free).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`, now."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            # The parent is the second field after the command, which may hold spaces.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def worker_pid(launcher_pid: int, url: str) -> int | None:
    """The launcher's child that serves `url` (matched by its ``--port``), if any."""
    port = url.rsplit(":", 1)[1].encode()
    for pid in child_pids(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
            return pid
    return None


def process_facts(pid: int) -> dict[str, Any]:
    """A process's resident memory (MiB) and open file descriptors. `rss_mib` is split into
    `anon_mib` (its heap: where a leak grows) and the rest (mapped files and shared memory,
    such as a KV cache segment other workers map)."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )

    def mib(key: str) -> float:
        return round(int(status[key].split()[0]) / 1024, 1)  # "1234 kB"

    return {
        "pid": pid,
        "rss_mib": mib("VmRSS"),
        "anon_mib": mib("RssAnon"),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def metric_values(url: str, auth: httpx.Auth | None = None) -> dict[str, float]:
    """A server's samples by name, its label sets summed; `auth`: a fleet worker's
    (`api.signing.FleetAuth`)."""
    text = httpx.get(f"{url}/metrics", auth=auth, trust_env=False, timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def num_held_blocks(url: str, auth: httpx.Auth | None = None) -> int:
    """KV blocks a worker holds for requests or leases."""
    values = metric_values(url, auth)
    return round(values["pdserve:kv_cache_total_blocks"] - values["pdserve:kv_cache_free_blocks"])
