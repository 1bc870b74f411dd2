"""The one-host launcher's parts: core assignment, worker flags, pinned worker processes,
startup failure."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import httpx
import pytest

from pdserve.fleet import FLEET_SECRET_ENV
from pdserve.kv_store.config import KV_STORE_NAMESPACE_SECRET_ENV, KV_STORE_PASSWORD_ENV
from pdserve.launch import local
from pdserve.launch.cli import deployment_config_from_args
from pdserve.launch.deployment import kv_store_secrets, worker_secrets
from pdserve.launch.local import assign_cores, plan_workers
from pdserve.launch.worker_group import (
    PortTakenError,
    WorkerGroup,
    WorkerSpec,
    WorkerStartupError,
)
from pdserve.ports import free_port
from tests.router.harness import REPO_ROOT, wait_until


def test_two_cores_two_workers_get_one_core_each():
    assert assign_cores([0, 1], 2) == [(0,), (1,)]


def test_cores_split_evenly_leftovers_to_the_first_workers():
    assert assign_cores(range(16), 2) == [tuple(range(8)), tuple(range(8, 16))]
    assert assign_cores([4, 5, 6], 2) == [(4, 5), (6,)]


def test_more_workers_than_cores_share_round_robin():
    assert assign_cores([0, 1], 3) == [(0,), (1,), (0,)]
    with pytest.raises(ValueError, match="at least one worker"):
        assign_cores([0], 0)


def serve_parser() -> argparse.ArgumentParser:
    """The `pdserve serve` parser."""
    from pdserve.launch.cli import add_parser

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_parser(subparsers)
    return subparsers.choices["serve"]


def test_workers_get_engine_and_server_flags_but_not_the_launchers():
    args = serve_parser().parse_args(
        [
            "--mode",
            "disagg",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--model",
            "m.gguf",
            "--max-num-seqs",
            "8",
            "--no-prefix-caching",
            "--served-model-name",
            "a",
            "b",
            "--kv-transport",
            "tcp",
            "--prefill-workers",
            "2",
            "--policy",
            "prefix_aware",
            "--local-prefill-threshold",
            "64",
            "--num-threads",
            "4",
        ]
    )
    assert deployment_config_from_args(args).worker_argv("decode") == [
        "--served-model-name",
        "a",
        "b",
        "--model",
        "m.gguf",
        "--max-num-seqs",
        "8",
        "--no-prefix-caching",
        "--kv-transport",
        "tcp",
    ]


def test_the_store_password_reaches_workers_in_their_environment_never_argv(tmp_path, monkeypatch):
    password_file = tmp_path / "redis-password"
    password_file.write_text("from-file\n")
    in_file = ["--kv-store", "redis://tenant-a@h:6379/0"]
    in_file += ["--kv-store-password-file", str(password_file)]
    for flags, password in (
        (["--kv-store", "redis://tenant-a:in-url@h:6379/0"], "in-url"),
        (in_file, "from-file"),
    ):
        args = serve_parser().parse_args(["--mode", "disagg", *flags])
        deployment = deployment_config_from_args(args)
        assert deployment.worker_argv("prefill") == ["--kv-store", "redis://tenant-a@h:6379/0"]
        assert kv_store_secrets(deployment) == {KV_STORE_PASSWORD_ENV: password}
    monkeypatch.setenv(KV_STORE_PASSWORD_ENV, "from-env")
    monkeypatch.setenv(KV_STORE_NAMESPACE_SECRET_ENV, "tenant-secret")
    args = serve_parser().parse_args(["--mode", "disagg", "--kv-store", "redis://h:6379/0"])
    assert deployment_config_from_args(args).worker_argv("decode") == [
        "--kv-store",
        "redis://h:6379/0",
    ]
    assert worker_secrets("fleet", kv_store_secrets(deployment_config_from_args(args))) == {
        FLEET_SECRET_ENV: "fleet",
        KV_STORE_PASSWORD_ENV: "from-env",
        KV_STORE_NAMESPACE_SECRET_ENV: "tenant-secret",
    }
    assert worker_secrets(None, {}) == {}


def test_plan_pins_prefill_then_decode_workers(tmp_path):
    args = serve_parser().parse_args(
        [
            "--mode",
            "disagg",
            "--worker-log-dir",
            str(tmp_path),
            "--worker-base-port",
            "9100",
            "--seed",
            "3",
        ]
    )
    prefill, decode = plan_workers(deployment_config_from_args(args))
    assert (prefill.name, prefill.port, decode.name, decode.port) == (
        "prefill-0",
        9100,
        "decode-0",
        9101,
    )
    assert prefill.command[2:7] == ("pdserve.cli", "serve", "--role", "prefill", "--host")
    assert decode.command[decode.command.index("--num-threads") + 1] == str(len(decode.cores))
    assert decode.command[-2:] == ("--seed", "3")
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(prefill.cores) & set(decode.cores)
    assert decode.log_path == tmp_path / "decode-0.log"


def test_a_plan_never_gives_two_workers_one_port(tmp_path, monkeypatch):
    # A free port's check closes it, so the next draw may return it again.
    draws = iter([41001, 41001, 41003])
    monkeypatch.setattr(local, "free_port", lambda: next(draws))
    args = serve_parser().parse_args(["--mode", "disagg", "--worker-log-dir", str(tmp_path)])
    prefill, decode = plan_workers(deployment_config_from_args(args))
    assert (prefill.port, decode.port) == (41001, 41003)


def test_role_worker_args_reach_only_that_role_and_win_over_worker_args(tmp_path):
    args = serve_parser().parse_args(
        [
            "--mode",
            "disagg",
            "--worker-log-dir",
            str(tmp_path),
            "--worker-args",
            "--max-num-batched-tokens 512 --max-num-seqs 4",
            "--decode-worker-args",
            "--max-num-batched-tokens 128",
        ]
    )
    prefill, decode = plan_workers(deployment_config_from_args(args))
    parsed = {w.role: serve_parser().parse_args(w.command[4:]) for w in (prefill, decode)}
    assert parsed["prefill"].max_num_batched_tokens == 512
    assert parsed["decode"].max_num_batched_tokens == 128
    assert parsed["prefill"].max_num_seqs == parsed["decode"].max_num_seqs == 4


def test_each_worker_logs_its_steps_to_its_own_file(tmp_path):
    args = serve_parser().parse_args(
        [
            "--mode",
            "disagg",
            "--worker-log-dir",
            str(tmp_path),
            "--step-log",
            str(tmp_path / "steps.jsonl"),
        ]
    )
    workers = plan_workers(deployment_config_from_args(args))
    logs = [w.command[w.command.index("--step-log") + 1] for w in workers]
    assert logs == [str(tmp_path / "steps.prefill-0.jsonl"), str(tmp_path / "steps.decode-0.jsonl")]


def stub_spec(tmp_path, name: str, cores: tuple[int, ...]) -> WorkerSpec:
    port = free_port()
    command = (
        sys.executable,
        "-m",
        "tests.router.stub_worker",
        "--role",
        "decode",
        "--port",
        str(port),
    )
    return WorkerSpec(name, "decode", port, cores, command, tmp_path / f"{name}.log")


@pytest.mark.slow
def test_worker_group_pins_waits_for_health_and_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    cores = assign_cores(sorted(os.sched_getaffinity(0)), 2)
    specs = [stub_spec(tmp_path, f"w{i}", c) for i, c in enumerate(cores)]
    group = WorkerGroup(specs)
    try:
        group.start()
        group.wait_healthy(timeout_s=60)
        for spec in specs:
            assert httpx.get(f"{spec.url}/health", trust_env=False).status_code == 200
            assert os.sched_getaffinity(group.pid(spec.name)) == set(spec.cores)
    finally:
        group.stop(grace_s=10)
    for spec in specs:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{spec.url}/health", trust_env=False)


def test_a_worker_holds_its_port_from_its_start_and_a_taken_port_fails_at_once(tmp_path):
    # A worker that never binds anything itself (a model still loading): its port is already
    # its own, so nothing else on the host can take it meanwhile.
    sleeper = WorkerSpec(
        "decode-0",
        "decode",
        free_port(),
        (),
        (sys.executable, "-c", "import time; time.sleep(60)"),
        tmp_path / "decode-0.log",
    )
    group = WorkerGroup([sleeper])
    group.start()
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", sleeper.port))
        assert taken.value.errno == errno.EADDRINUSE
        # A second worker given the same port fails in start(), naming it; none is started.
        twin = dataclasses.replace(sleeper, name="decode-1", log_path=tmp_path / "decode-1.log")
        with pytest.raises(PortTakenError, match=f"decode-1: cannot bind 127.0.0.1:{sleeper.port}"):
            WorkerGroup([twin]).start()
        assert not twin.log_path.exists()
    finally:
        group.stop(grace_s=5)


def test_a_worker_dying_at_startup_is_reported_with_its_log_tail(tmp_path):
    dying = WorkerSpec(
        "prefill-0",
        "prefill",
        free_port(),
        (0,),
        (sys.executable, "-c", "print('cannot load model x'); raise SystemExit(3)"),
        tmp_path / "prefill-0.log",
    )
    group = WorkerGroup([dying])
    group.start()
    with pytest.raises(WorkerStartupError, match=r"(?s)exited with code 3.*cannot load model x"):
        group.wait_healthy(timeout_s=30, poll_s=0.05)
    group.stop()


@pytest.mark.slow
def test_launch_local_exits_1_when_a_worker_cannot_start(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from tests.launch.test_launcher import serve_parser
        from pdserve.launch.cli import deployment_config_from_args
        from pdserve.launch.local import launch_local
        args = serve_parser().parse_args([
            "--mode", "disagg", "--worker-log-dir", {str(tmp_path)!r},
            "--worker-args=--no-such-flag", "--startup-timeout", "120"])
        sys.exit(launch_local(deployment_config_from_args(args)))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 1, result.stderr
    assert "exited with code 2 during startup" in result.stderr
    assert "--no-such-flag" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-0.log", "prefill-0.log"]


@pytest.mark.slow
def test_launch_local_serves_through_stub_workers_and_stops_them_on_sigterm(tmp_path):
    """The whole launcher (workers, health wait, router, signals) with stub workers standing
    in for `pdserve serve --role ...` (its plan is swapped in the child process)."""
    router_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import pdserve.launch.local as launcher
        from pdserve.launch.worker_group import WorkerSpec
        from pdserve.launch.cli import deployment_config_from_args
        from tests.launch.test_launcher import serve_parser

        def stub(role, port, core):
            command = (sys.executable, "-m", "tests.router.stub_worker", "--role", role,
                       "--port", str(port))
            return WorkerSpec(f"{{role}}-0", role, port, (core,), command,
                              Path({str(tmp_path)!r}) / f"{{role}}.log")

        cores = sorted(launcher.os.sched_getaffinity(0))
        launcher.plan_workers = lambda args: [stub("prefill", {prefill_port}, cores[0]),
                                              stub("decode", {decode_port}, cores[-1])]
        args = serve_parser().parse_args(["--mode", "disagg", "--port", "{router_port}"])
        sys.exit(launcher.launch_local(deployment_config_from_args(args)))
    """)
    launcher_process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    router = f"http://127.0.0.1:{router_port}"
    try:
        wait_until(lambda: _is_up(router) or launcher_process.poll() is not None, 120)
        assert launcher_process.poll() is None, launcher_process.stderr.read()
        response = httpx.post(
            f"{router}/v1/completions",
            trust_env=False,
            timeout=30,
            json={"prompt": "hi", "max_tokens": 2},
        )
        assert response.status_code == 200
        assert json.loads(response.headers["x-pdserve-timing"])["route"] == "remote"
    finally:
        launcher_process.send_signal(signal.SIGTERM)
        out, err = launcher_process.communicate(timeout=60)
    assert launcher_process.returncode == 0, err
    assert f"serving on {router}" in out
    for port in (prefill_port, decode_port, router_port):
        assert not _is_up(f"http://127.0.0.1:{port}")


def _is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", trust_env=False, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
