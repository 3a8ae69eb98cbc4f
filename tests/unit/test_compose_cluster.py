"""The cluster override, the cluster with credentials, and the site file, read as data: three routed nodes every
service lists, a leaf-node listener only where sites log in with their credentials over TLS, a site that runs
`cleave site` on exactly the files `cleave auth init --sites` writes for it, and nats configs the real
nats-server accepts (`nats-server -t`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cleave_cli.main import build_parser
from cleave_cli.natsconf import nats_server_binary
from tests.unit.test_compose import BASE, COMPOSE, SERVICES, build_auth_parser, load, resolve

CLUSTER = resolve(load("docker-compose.cluster.yml"))
CLUSTER_AUTH = resolve(load("docker-compose.cluster-auth.yml"))
SITE = resolve(load("docker-compose.site.yml"))
NODES = ("nats", "nats-2", "nats-3")


def role_env(service: str, var: str) -> str:
    return f"CLEAVE_{SERVICES[service].upper()}_{var}"


def test_the_cluster_runs_three_named_nodes_on_their_own_volumes():
    nodes = {n: CLUSTER["services"][n] for n in NODES}
    assert {s["environment"]["NATS_SERVER_NAME"] for s in nodes.values()} == {"nats-1", "nats-2", "nats-3"}
    volumes = [s["volumes"][1].split(":")[0] for s in nodes.values()]
    assert len(set(volumes)) == 3 and set(volumes) - {"nats-data"} <= set(CLUSTER["volumes"])


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_connects_with_the_three_nodes(service):
    for override, scheme in ((CLUSTER, "nats"), (CLUSTER_AUTH, "tls")):
        url = override["services"][service]["environment"][role_env(service, "NATS_URL")]
        assert [u.split("//")[0] for u in url.split(",")] == [f"{scheme}:"] * 3
        assert [u.split("//")[1].split(":")[0] for u in url.split(",")] == list(NODES)
    assert set(BASE["services"][service]["environment"]) == set(CLUSTER["services"][service]["environment"])


def test_the_plain_cluster_takes_no_leaf_nodes():
    """Without credentials a leaf link would bypass every role's permissions: sites join the cluster with auth."""
    assert "leafnodes" not in (COMPOSE / "nats" / "cluster.conf").read_text()
    env = {**os.environ, "NATS_SERVER_NAME": "nats-2"}
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(COMPOSE / "nats" / "cluster.conf")], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_with_credentials_every_node_runs_the_auth_config_under_its_own_name(tmp_path: Path):
    names = []
    for node in NODES:
        command = CLUSTER_AUTH["services"][node]["command"]
        assert command[command.index("--config") + 1] == "/etc/nats/auth/nats.conf"
        names.append(command[command.index("--name") + 1])
    assert len(set(names)) == 3
    for node in ("nats-2", "nats-3"):
        mounts = [v.split(":")[0] for v in CLUSTER_AUTH["services"][node]["volumes"]]
        assert mounts == ["./auth/nats.conf", "./auth/tls"], "the config and the TLS files: never the seeds"
    out = tmp_path / "auth"
    build_args = ["auth", "init", "--out", str(out), "--tls", "--cluster", ",".join(NODES), "--sites", "lab"]
    from cleave_cli import auth_cmd

    auth_cmd.init(build_auth_parser().parse_args(build_args))
    text = (out / "nats.conf").read_text()
    for node in NODES:
        assert f'"nats-route://{node}:6222"' in text
    assert "leafnodes" in text and "verify: true" in text
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(out / "nats.conf"), "--name", "nats-2"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_site_runs_cleave_site_on_the_files_auth_init_writes_for_it(tmp_path: Path):
    site, worker = SITE["services"]["site"], SITE["services"]["worker"]
    args = build_parser().parse_args(site["command"])
    assert args.command == "site" and args.hub == ["tls://nats:7422"] and args.auth is None  # seeds from env
    assert args.listen.startswith("0.0.0.0:") and site["ports"][0].endswith(":4222")
    assert site["environment"] == {"CLEAVE_SITE_NATS_TLS_CA": "/etc/cleave/ca.pem"}
    assert worker["environment"]["CLEAVE_WORKER_NATS_URL"] == "nats://site:4222"
    assert build_parser().parse_args(worker["command"]).command == "worker"
    from cleave_cli import auth_cmd

    auth_cmd.init(build_auth_parser().parse_args(["auth", "init", "--out", str(tmp_path / "auth"), "--tls",
                                                  "--sites", "site"]))
    folder = tmp_path / "auth" / "sites" / "site"
    files = {e["path"] for s in (site, worker) for e in s["env_file"]} | {
        v.split(":")[0] for v in site["volumes"]}
    assert {f.replace("./site/", "") for f in files} == {"site.env", "worker.env", "ca.pem"}
    for f in files:
        assert (folder / f.replace("./site/", "")).is_file(), f
    env = {}
    for f in ("site.env", "worker.env"):
        env.update(auth_cmd.read_env(folder / f))
    assert set(env) == {"CLEAVE_SITE_NATS_NKEY_SEED", "CLEAVE_WORKER_NATS_NKEY_SEED"}  # what `cleave site` reads
