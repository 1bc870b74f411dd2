"""The Ray placement's parts that need no cluster: --cluster addresses, resource JSON, actor
options, and what every worker of a pool is started with."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.launch.cli import deployment_config_from_args
from pdserve.launch.ray_cluster import (
    RayPlan,
    actor_options,
    num_threads,
    parse_resources,
    ray_address,
)
from tests.launch.test_launcher import serve_parser
from tests.router.harness import REPO_ROOT

SECRET = "the-fleet-secret"


def test_cluster_addresses(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address("ray") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address("ray") == "10.0.0.1:6379"
    assert ray_address("ray:local") == "local"
    assert ray_address("ray://head:10001") == "ray://head:10001"
    assert ray_address("ray:ray://head:10001") == "ray://head:10001"
    for bad in ("k8s", "ray:", "Ray"):
        with pytest.raises(ValueError, match="--cluster"):
            ray_address(bad)


def test_resources_in_rays_spelling_default_to_one_cpu():
    assert parse_resources(None, "--decode-worker-resources") == {"CPU": 1.0}
    resources = parse_resources('{"GPU": 1, "pool_decode": 0.5}', "--decode-worker-resources")
    assert resources == {"CPU": 1.0, "GPU": 1.0, "pool_decode": 0.5}
    assert actor_options(resources) == {
        "num_cpus": 1.0,
        "num_gpus": 1.0,
        "resources": {"pool_decode": 0.5},
    }
    assert actor_options({"CPU": 2.5, "memory": 1e9}) == {
        "num_cpus": 2.5,
        "num_gpus": 0,
        "memory": 1e9,
    }
    assert num_threads({"CPU": 2.5}) == 2 and num_threads({"CPU": 0.5}) == 1


@pytest.mark.parametrize("text", ["{CPU: 1}", "[1]", '{"CPU": "one"}', '{"CPU": -1}', "true"])
def test_bad_resources_name_the_flag(text):
    with pytest.raises(ValueError, match="--prefill-worker-resources"):
        parse_resources(text, "--prefill-worker-resources")


def _plan(*flags: str):
    args = serve_parser().parse_args(["--mode", "disagg", *flags])
    return RayPlan.from_deployment(deployment_config_from_args(args), SECRET)


def test_each_pool_gets_its_flags_resources_and_a_transport_that_crosses_nodes():
    plan = _plan(
        *("--cluster", "ray", "--decode-worker-args", "--max-num-batched-tokens 128"),
        *("--max-num-seqs", "4", "--decode-worker-resources", '{"CPU": 2}'),
    )
    assert plan.argv["decode"] == ("--max-num-seqs", "4", "--max-num-batched-tokens", "128")
    assert plan.argv["prefill"] == ("--max-num-seqs", "4")
    assert plan.resources == {"prefill": {"CPU": 1.0}, "decode": {"CPU": 2.0}}
    assert plan.kv_transport == "auto"  # shm, the one-host default, cannot cross nodes
    assert _plan("--kv-transport", "tcp").kv_transport == "tcp"
    assert plan.secret == SECRET and SECRET not in repr(plan)
    with pytest.raises(ValueError, match="--worker-base-port"):
        _plan("--cluster", "ray", "--worker-base-port", "9000")


def test_pdserve_imports_without_ray():
    script = "import sys; sys.modules['ray'] = None; import pdserve.cli, pdserve.launch.ray_cluster"
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=120)


def test_replicas_are_plain_servers_of_their_mode_with_the_decode_pools_resources():
    args = serve_parser().parse_args(
        [
            *("--mode", "chunked", "--data-parallel-size", "3", "--cluster", "ray"),
            *("--max-num-seqs", "4", "--decode-worker-args", "--max-num-batched-tokens 128"),
            *("--decode-worker-resources", '{"CPU": 2}'),
        ]
    )
    plan = RayPlan.from_deployment(deployment_config_from_args(args), SECRET)
    assert plan.role_argv["decode"] == ("--mode", "chunked")
    assert plan.argv["decode"] == ("--max-num-seqs", "4")  # a disagg decode pool's flags: no
    assert plan.resources["decode"] == {"CPU": 2.0}
    assert plan.kv_transport is None  # replicas move no KV
    assert _plan().role_argv == {"prefill": ("--role", "prefill"), "decode": ("--role", "decode")}


def test_autoscaling_is_for_disaggregated_pools():
    from pdserve.launch.cli import run

    with pytest.raises(ValueError, match="--autoscale sizes the pools of --mode disagg"):
        run(serve_parser().parse_args(["--mode", "chunked", "--autoscale", "--cluster", "ray"]))


@pytest.mark.parametrize(
    "flags",
    [
        ["--decode-worker-resources", '{"GPU": 1}'],
        ["--prefill-worker-resources", '{"CPU": 2}'],
        ["--placement-strategy", "spread"],
    ],
)
def test_placement_flags_without_a_cluster_are_refused(flags):
    from pdserve.launch.cli import run

    with pytest.raises(ValueError, match=f"{flags[0]} places workers on a cluster"):
        run(serve_parser().parse_args(["--mode", "disagg", *flags]))
