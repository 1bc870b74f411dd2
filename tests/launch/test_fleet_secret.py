"""The fleet secret on one host (`serve --mode disagg --worker-auth`): the launcher hands it to
its workers in their environment, never in argv; the router signs every leg with it; a client
without it is refused by the workers' HTTP and KV ports. Without `--worker-auth` (the one-host
default) workers stay open, as the other disaggregation tests rely on."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pdserve.api.signing import FleetAuth
from pdserve.fleet import FLEET_SECRET_ENV
from pdserve.kv_transfer import KVAuthError, KVTransferParams
from pdserve.kv_transfer.client import KVClient, release_lease
from pdserve.launch.cli import deployment_config_from_args
from pdserve.launch.local import plan_workers
from tests.launch.test_launcher import serve_parser
from tests.router.real_workers import Disagg

SECRET = "one-host-fleet-secret"


def test_worker_auth_is_off_on_one_host_unless_asked(tmp_path):
    args = serve_parser().parse_args(["--mode", "disagg", "--worker-log-dir", str(tmp_path)])
    assert args.worker_auth is None  # the launcher reads None as: off here, on a cluster
    workers = plan_workers(deployment_config_from_args(args))
    assert all(SECRET not in " ".join(w.command) for w in workers)


@pytest.mark.slow
def test_one_host_deployment_with_worker_auth_lets_only_the_fleet_in(tmp_path, monkeypatch):
    monkeypatch.setenv(FLEET_SECRET_ENV, SECRET)  # the operator's secret, for this test to use
    disagg = Disagg(tmp_path, "auth", "--worker-auth")
    try:
        disagg.wait_healthy()
        body = {"prompt": "The fleet " * 40, "max_tokens": 4, "temperature": 0}
        routed = httpx.post(f"{disagg.url}/v1/completions", json=body, trust_env=False, timeout=600)
        assert routed.status_code == 200, routed.text
        assert json.loads(routed.headers["x-pdserve-timing"])["route"] == "remote"
        for worker_id, worker in disagg.workers().items():
            argv = Path(f"/proc/{disagg.worker_pid(worker_id)}/cmdline").read_bytes()
            assert SECRET.encode() not in argv
            for headers in ({}, {"Authorization": f"Bearer {SECRET}"}):
                refused = httpx.post(
                    f"{worker['url']}/v1/completions", json=body, headers=headers, trust_env=False
                )
                assert refused.status_code == 401
        leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        answer = httpx.post(
            f"{disagg.worker_url('prefill-0')}/v1/completions",
            json=leg,
            auth=FleetAuth(SECRET),
            trust_env=False,
            timeout=600,
        )
        params = KVTransferParams.from_dict(answer.json()["kv_transfer_params"])
        with pytest.raises(KVAuthError):
            KVClient(params.remote_host, params.remote_port, timeout=10).hello()
        assert release_lease(params, timeout=10, secret=SECRET) is True
        # The router's health checks carry the secret: the workers stay in rotation.
        assert len(disagg.healthy_worker_urls()) == 2
    finally:
        disagg.process.stop(timeout=60)
