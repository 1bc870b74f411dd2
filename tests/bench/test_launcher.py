"""Starting, health-checking and stopping server processes."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from pdserve.bench.launcher import LaunchConfig, launch_server, stop_process
from pdserve.workload.errors import BenchError
from tests.bench.conftest import REPO_ROOT, stub_launch_config

pytestmark = pytest.mark.slow


def test_launch_waits_for_health_and_stops_with_sigterm(tmp_path):
    config = stub_launch_config(tmp_path, "--itl-ms", "5", with_mode=True)
    with launch_server(config, "chunked") as server:
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert "--mode" in server.process.args and "chunked" in server.process.args
        assert server.log_path == tmp_path / "server-chunked.log"
    # Stopped by its SIGTERM handling (uvicorn re-raises the signal after shutting down),
    # well within the grace period: no SIGKILL.
    assert server.exit_code in (0, -15)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health")


def test_a_server_that_exits_early_reports_its_log(tmp_path):
    script = "import sys; print('model file is missing', file=sys.stderr); sys.exit(3)"
    config = LaunchConfig(command=("{python}", "-c", script), log_dir=tmp_path, cwd=REPO_ROOT)
    with pytest.raises(BenchError) as info, launch_server(config, "disagg"):
        pass
    message = str(info.value)
    assert "the disagg server exited with code 3" in message
    assert "model file is missing" in message


def test_a_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
    # Ignores SIGTERM, so stopping it needs the SIGKILL after the grace period.
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('loading', flush=True); time.sleep(60)"
    )
    config = LaunchConfig(
        command=("{python}", "-c", script),
        health_timeout_s=1.0,
        stop_grace_s=0.5,
        log_dir=tmp_path,
    )
    pattern = r"(?s)not healthy .* within 1 s; last lines .*loading"
    with pytest.raises(BenchError, match=pattern), launch_server(config, "colocated"):
        pass


def test_stop_process_escalates_to_sigkill():
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "ready\n"  # the handler is in place
    assert stop_process(process, grace_s=0.3) == -9
    process.stdout.close()


def test_command_template_placeholders():
    config = LaunchConfig(
        command=("x", "--mode", "{mode}", "--port={port}", "{host}"),
        extra_args=("--max-num-seqs", "4", "--step-log", "steps-{mode}.jsonl"),
    )
    assert config.argv("chunked", 8123) == [
        "x",
        "--mode",
        "chunked",
        "--port=8123",
        "127.0.0.1",
        "--max-num-seqs",
        "4",
        "--step-log",
        "steps-chunked.jsonl",
    ]
    with pytest.raises(BenchError, match=r"bad placeholder 'model'"):
        LaunchConfig(command=("x", "{model}")).argv("chunked", 1)


def test_one_modes_own_args_come_last():
    config = LaunchConfig(
        command=("x", "{mode}"),
        extra_args=("--budget", "512"),
        mode_args={"chunked": ("--budget", "256", "--log={mode}.jsonl")},
    )
    assert config.argv("chunked", 1) == [
        "x",
        "chunked",
        "--budget",
        "512",
        "--budget",
        "256",
        "--log=chunked.jsonl",
    ]
    assert config.argv("disagg", 1) == ["x", "disagg", "--budget", "512"]
    with pytest.raises(BenchError, match="--server-cmd is empty"):
        LaunchConfig(command=())
