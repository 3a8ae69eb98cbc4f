"""The cluster override and the site profile, read as data: three routed nodes every service lists, a leaf
node the site's workers use, and nats configs the real nats-server accepts (`nats-server -t`)."""

from __future__ import annotations

import os
import subprocess

import pytest

from cleave_cli.main import build_parser
from cleave_cli.natsconf import nats_server_binary
from tests.unit.test_compose import BASE, COMPOSE, ROLES, load, resolve

CLUSTER = resolve(load("docker-compose.cluster.yml"))
SITE = resolve(load("docker-compose.site.yml"))
NODES = ("nats", "nats-2", "nats-3")


def test_the_cluster_runs_three_named_nodes_on_their_own_volumes():
    nodes = {n: CLUSTER["services"][n] for n in NODES}
    assert {s["environment"]["NATS_SERVER_NAME"] for s in nodes.values()} == {"nats-1", "nats-2", "nats-3"}
    volumes = [s["volumes"][1].split(":")[0] for s in nodes.values()]
    assert len(set(volumes)) == 3 and set(volumes) - {"nats-data"} <= set(CLUSTER["volumes"])


@pytest.mark.parametrize("role", ROLES)
def test_every_service_connects_with_the_three_nodes(role):
    url = CLUSTER["services"][role]["environment"][f"CLEAVE_{role.upper()}_NATS_URL"]
    assert [u.split("//")[1].split(":")[0] for u in url.split(",")] == list(NODES)
    assert set(BASE["services"][role]["environment"]) == set(CLUSTER["services"][role]["environment"])


def test_the_site_profile_runs_a_leaf_node_and_its_workers():
    leaf, worker = SITE["services"]["nats-leaf"], SITE["services"]["site-worker"]
    assert leaf["profiles"] == worker["profiles"] == ["site"]
    assert worker["environment"]["CLEAVE_WORKER_NATS_URL"] == "nats://nats-leaf:4222"
    assert build_parser().parse_args(worker["command"]).command == "worker"
    hubs = [v for k, v in leaf["environment"].items() if k.startswith("CLEAVE_SITE_HUB_")]
    assert [h.split("//")[1] for h in hubs] == [f"{n}:7422" for n in NODES]


@pytest.mark.parametrize(("conf", "service"), [("cluster.conf", "nats-2"), ("leaf.conf", "nats-leaf")])
def test_the_nats_configs_parse(conf, service):
    merged = {**CLUSTER["services"], **SITE["services"]}
    env = {**os.environ, **{k: str(v) for k, v in merged[service]["environment"].items()}}
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(COMPOSE / "nats" / conf)], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (COMPOSE / "nats" / conf).read_text()
    assert ("sync_interval: always" in text) == (conf == "cluster.conf")
