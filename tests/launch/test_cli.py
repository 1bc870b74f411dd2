"""`pdserve serve`'s flags: grouped, each declared once, defaults from their config fields,
and every one a worker needs handed on to it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

from pdserve.core.config import Mode
from pdserve.engine.args import (
    ENGINE_FLAGS,
    KV_STORE_FLAGS,
    KV_TRANSFER_FLAGS,
    engine_config_from_args,
)
from pdserve.kv_store.config import split_password
from pdserve.launch.cli import (
    CLUSTER_FLAGS,
    DISAGG_FLAGS,
    REPLICA_FLAGS,
    deployment_config_from_args,
)
from pdserve.launch.deployment import PER_WORKER_FLAGS, WORKER_FLAGS
from pdserve.launch.local import plan_workers
from pdserve.router.cli import AUTOSCALE_FLAGS, ROUTER_FLAGS, ROUTING_FLAGS
from pdserve.router.cli import add_parser as add_router_parser
from pdserve.server.cli import SERVER_FLAGS
from tests.launch.test_launcher import serve_parser

GROUPS = (
    "server",
    "engine",
    "KV transfer (disaggregated workers)",
    "shared KV store",
    "data parallel (--mode colocated|chunked)",
    "disaggregation (--mode disagg)",
    "cluster (replicas or --mode disagg)",
    "routing (replicas or --mode disagg)",
    "autoscaling (--mode disagg)",
)


def help_sections(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each heading of `parser`'s help and the options listed under it, in order."""
    sections: dict[str, list[str]] = {}
    heading = None
    for line in parser.format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            sections[heading] = []
        elif heading and (match := re.match(r"  (--[\w-]+)", line)):
            sections[heading].append(match.group(1))
    return sections


def test_serve_help_is_grouped_and_lists_each_flag_once():
    sections = help_sections(serve_parser())
    assert [h for h in sections if h != "options"] == list(GROUPS)
    listed = [name for options in sections.values() for name in options]
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    declared = (
        SERVER_FLAGS,
        ENGINE_FLAGS,
        KV_TRANSFER_FLAGS,
        KV_STORE_FLAGS,
        REPLICA_FLAGS,
        DISAGG_FLAGS,
        CLUSTER_FLAGS,
        ROUTING_FLAGS,
        AUTOSCALE_FLAGS,
    )
    for heading, flags in zip(GROUPS, declared, strict=True):
        assert sections[heading] == [f.name for f in flags]


def test_router_help_shares_the_routing_declarations():
    subparsers = argparse.ArgumentParser().add_subparsers()
    add_router_parser(subparsers)
    sections = help_sections(subparsers.choices["router"])
    assert sections["routing"] == [f.name for f in ROUTING_FLAGS]
    assert sections["options"] == [f.name for f in ROUTER_FLAGS]


def test_no_flags_give_the_default_config():
    from pdserve.engine.config import EngineConfig

    assert engine_config_from_args(serve_parser().parse_args([])) == EngineConfig()


# Each (module, class, field) whose default a command line shows, with a value unlike any
# default, and where it must show up.
PATCHES = [
    ("pdserve.core.config", "SchedulerConfig", "max_num_seqs", 7),
    ("pdserve.core.config", "SchedulerConfig", "max_num_partial_prefills", 3),
    ("pdserve.core.config", "CacheConfig", "block_size", 32),
    ("pdserve.core.config", "CacheConfig", "kv_cache_memory_gb", 2.5),
    ("pdserve.kv_transfer.config", "KVTransferConfig", "transport", "tcp"),
    ("pdserve.kv_transfer.config", "KVTransferConfig", "kv_lease_timeout", 12.5),
    ("pdserve.engine.config", "EngineConfig", "seed", 5),
    ("pdserve.kv_store.config", "KVStoreConfig", "max_gb", 7.5),
    ("pdserve.engine.config", "EngineConfig", "kv_failure_policy", "fail"),
    ("pdserve.server.settings", "ServerSettings", "max_queue", 9),
    ("pdserve.router.config", "RouterConfig", "balance_factor", 3.5),
    ("pdserve.router.config", "RouterConfig", "unhealthy_threshold", 4),
    ("pdserve.sim.config", "SimConfig", "memory_utilization", 0.5),
    ("pdserve.router.autoscale.config", "AutoscaleConfig", "interval_s", 4.5),
    ("pdserve.router.autoscale.config", "AutoscaleConfig", "max_decode_workers", 6),
]
CHANGED = """
import importlib, json, sys
for module, cls, field, value in json.loads(sys.argv[1]):
    setattr(getattr(importlib.import_module(module), cls), field, value)
from pdserve.cli import build_parser
parser = build_parser()
serve = parser.parse_args(["serve"])
router = parser.parse_args(["router", "--decode", "http://127.0.0.1:1"])
simulate = parser.parse_args(["simulate"])
from pdserve.router.config import RouterConfig
print(json.dumps({
    "serve": vars(serve),
    "router": vars(router),
    "simulate": vars(simulate),
    "RouterConfig.block_size": RouterConfig.block_size,
}, default=str))
"""


def test_a_default_changed_in_its_field_shows_in_every_command_line():
    """Each field is patched before the command lines are built (a fresh interpreter): no
    flag keeps a literal of its own."""
    result = subprocess.run(
        [sys.executable, "-c", CHANGED, json.dumps(PATCHES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    serve, router, simulate = seen["serve"], seen["router"], seen["simulate"]
    assert (serve["max_num_seqs"], serve["max_num_partial_prefills"]) == (7, 3)
    assert (serve["block_size"], router["block_size"], simulate["block_size"]) == (32, 32, 32)
    assert seen["RouterConfig.block_size"] == 32  # SimConfig embeds CacheConfig and RouterConfig
    assert serve["kv_cache_memory_gb"] == 2.5
    assert serve["kv_store_max_gb"] == 7.5
    assert (serve["kv_transport"], serve["kv_lease_timeout"]) == ("tcp", 12.5)
    assert (serve["seed"], serve["kv_failure_policy"], serve["max_queue"]) == (5, "fail", 9)
    assert serve["balance_factor"] == router["balance_factor"] == 3.5
    assert serve["unhealthy_threshold"] == router["unhealthy_threshold"] == 4
    assert simulate["max_num_partial_prefills"] == 3
    assert simulate["memory_utilization"] == 0.5
    assert (serve["interval_s"], serve["max_decode_workers"]) == (4.5, 6)


def test_workers_take_the_engine_kv_and_server_limit_flags_and_nothing_else():
    names = [f.name for f in WORKER_FLAGS]
    assert len(names) == len(set(names))
    for flags in (ENGINE_FLAGS, KV_TRANSFER_FLAGS, KV_STORE_FLAGS, SERVER_FLAGS):
        assert {f.name for f in flags} <= set(names) | PER_WORKER_FLAGS
    assert not {
        f.name for f in (*DISAGG_FLAGS, *CLUSTER_FLAGS, *ROUTING_FLAGS, *AUTOSCALE_FLAGS)
    } & set(names)


# Every worker flag at a value other than its default, and the launcher's own.
EVERY_WORKER_FLAG = [
    *("--served-model-name", "a", "b", "--max-queue", "3", "--max-body-bytes", "1000"),
    *("--burst-gap", "0.01"),
    *("--shutdown-grace", "1.5", "--health-timeout", "2.5", "--model", "m.gguf"),
    *("--dtype", "float16", "--device", "cpu", "--max-num-batched-tokens", "256"),
    *("--quantization", "int8", "--kv-cache-dtype", "bfloat16"),
    *("--max-num-seqs", "8", "--long-prefill-token-threshold", "100"),
    *("--max-num-partial-prefills", "2", "--block-size", "32", "--num-kv-blocks", "99"),
    *("--kv-cache-memory-gb", "2.5", "--no-prefix-caching", "--max-model-len", "1000"),
    *("--seed", "7", "--kv-transport", "tcp", "--kv-host", "0.0.0.0", "--kv-port", "5555"),
    *("--kv-advertise-host", "h", "--kv-lease-timeout", "3", "--kv-transfer-timeout", "4"),
    *("--kv-node-id", "node-1"),
    *("--kv-failure-policy", "fail", "--kv-store", "redis://:pw@cache:6379/2"),
    *("--kv-store-max-gb", "0.5", "--kv-store-namespace", "team-a"),
]
LAUNCHER_FLAGS = [
    *("--mode", "disagg", "--port", "9000", "--api-key", "k", "--num-threads", "4"),
    *("--policy", "prefix_aware", "--local-prefill-threshold", "64", "--prefill-workers", "2"),
]


def test_each_worker_gets_every_flag_the_user_gave_it(tmp_path):
    assert {f.name for f in WORKER_FLAGS} <= set(EVERY_WORKER_FLAG)  # this test stays complete
    argv = [*EVERY_WORKER_FLAG, *LAUNCHER_FLAGS, "--worker-log-dir", str(tmp_path)]
    args = serve_parser().parse_args(argv)
    workers = plan_workers(deployment_config_from_args(args))
    assert [w.role for w in workers] == ["prefill", "prefill", "decode"]
    for worker in workers:
        assert worker.command[3] == "serve"
        parsed = serve_parser().parse_args(worker.command[4:])
        # All as given, but the store's password: that goes in the worker's environment.
        given = {**vars(args), "kv_store": split_password(args.kv_store)[0]}
        assert given["kv_store"] == "redis://cache:6379/2"
        for option in WORKER_FLAGS:
            assert getattr(parsed, option.dest) == given[option.dest], option.name
        # The engine each worker builds is the user's, in its role and on its own cores.
        own = {"role": worker.role, "mode": parsed.mode, "num_threads": parsed.num_threads}
        own["kv_store"] = given["kv_store"]
        expected = argparse.Namespace(**{**vars(args), **own})
        assert engine_config_from_args(parsed) == engine_config_from_args(expected)
        assert parsed.num_threads == len(worker.cores)
        launchers = {"--mode", "--api-key", "--policy", "--local-prefill-threshold"}
        assert not launchers & set(worker.command)


def test_a_shared_kv_store_tells_the_router_so():
    from pdserve.router.cli import router_config_from_args

    def config(*argv: str):
        return router_config_from_args(serve_parser().parse_args(list(argv)), [], ["http://d"])

    assert not config("--mode", "disagg").shared_kv_store
    assert config("--mode", "disagg", "--kv-store", "redis://cache:6379").shared_kv_store
    assert config("--mode", "disagg", "--shared-kv-store").shared_kv_store


def test_cluster_ray_without_ray_says_what_to_install(monkeypatch, capsys):
    from pdserve.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    assert main(["serve", "--mode", "disagg", "--cluster", "ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'pdserve[ray]'" in err and "Traceback" not in err


def test_every_command_line_offers_the_modes_of_the_one_enum():
    from pdserve.core.config import Mode
    from pdserve.sim.options import parse_modes

    serve = next(a for a in serve_parser()._actions if a.dest == "mode")
    assert list(serve.choices) == [mode.value for mode in Mode]
    assert parse_modes(",".join(serve.choices)) == list(Mode)


def test_routing_and_autoscale_flags_are_named_as_their_config_fields():
    """`config_from_args` maps by name: a flag whose dest is no field would be dropped."""
    import dataclasses

    from pdserve.launch.config import DeploymentConfig
    from pdserve.router.autoscale.config import AutoscaleConfig
    from pdserve.router.config import RouterConfig

    for flags, config, own in (
        (ROUTING_FLAGS, RouterConfig, {"policy"}),  # --policy: both pools' default
        (AUTOSCALE_FLAGS, AutoscaleConfig, {"autoscale"}),  # --autoscale: whether at all
        ((*DISAGG_FLAGS, *REPLICA_FLAGS, *CLUSTER_FLAGS), DeploymentConfig, set()),
    ):
        names = {f.name for f in dataclasses.fields(config)}
        assert {option.dest for option in flags} - names == own


def test_a_deployment_is_parsed_once_into_its_config_with_the_fields_defaults():
    from pdserve.launch.config import DeploymentConfig
    from pdserve.router.autoscale.config import SLO

    deployment = deployment_config_from_args(serve_parser().parse_args(["--mode", "disagg"]))
    assert deployment == DeploymentConfig(Mode.DISAGG, deployment.router)
    assert deployment.router.decode_urls == () and deployment.autoscale is None
    argv = ["--mode", "disagg", "--autoscale", "--slo", "ttft:500", "--max-workers", "3"]
    deployment = deployment_config_from_args(serve_parser().parse_args(argv))
    assert deployment.autoscale.slo == SLO(ttft_s=0.5)
    assert deployment.autoscale.within(2).total_limit == 2
    assert deployment.autoscale.within(8) is deployment.autoscale
    secret_router = deployment.router_config((), ("http://d:1",), "s")
    assert secret_router.decode_urls == ("http://d:1",) and secret_router.fleet_secret == "s"
