"""The PS replicas override, read as data: one `cleave ps` service per replica, their group settings as the
PS reads them (PsSettings, then the replica group the PS forms), and every replica the same service but for
its index, connected where the hub's runner is."""

from __future__ import annotations

import pytest

from cleave.train.job import JobConfig
from cleave_cli.main import build_parser
from cleave_ps.jobs.pretrain import replica_group
from cleave_ps.settings import PsSettings
from tests.unit.test_compose import BASE, env_names, load, resolve, settings_env

OVERRIDE = resolve(load("docker-compose.replicas.yml"))
GROUP_VARS = ("CLEAVE_PS_REPLICAS", "CLEAVE_PS_REPLICA", "CLEAVE_PS_REPLICA_ADDR", "CLEAVE_PS_REPLICA_PORT")
SAME_AS_PS = ("image", "build", "env_file", "restart", "stop_grace_period", "depends_on")


def merged() -> dict[str, dict]:
    """The services of `docker compose -f docker-compose.yml -f docker-compose.replicas.yml` (environment
    maps merged key by key, other keys replaced, as compose merges them)."""
    services = {name: dict(s) for name, s in BASE["services"].items()}
    for name, s in OVERRIDE["services"].items():
        base = services.get(name, {})
        services[name] = {**base, **s, "environment": {**base.get("environment", {}), **s.get("environment", {})}}
    return services


SERVICES = merged()
REPLICAS = {name: s for name, s in SERVICES.items() if s["command"][0] == "ps"}


def settings_of(service: dict, monkeypatch: pytest.MonkeyPatch) -> PsSettings:
    """What `cleave ps` reads in this container: its environment, nothing else."""
    for var in settings_env("ps"):
        monkeypatch.delenv(var, raising=False)
    for var, value in service["environment"].items():
        monkeypatch.setenv(var, str(value))
    return PsSettings()


def test_one_ps_service_per_replica_each_with_its_own_index(monkeypatch):
    settings = {}
    for name, service in REPLICAS.items():
        assert set(GROUP_VARS) <= env_names(service), f"{name} lacks a group setting"
        assert set(env_names(service)) <= settings_env("ps"), f"{name} sets what the PS does not read"
        settings[name] = settings_of(service, monkeypatch)
        monkeypatch.undo()
    sizes = {s.replicas for s in settings.values()}
    assert sizes == {len(REPLICAS)} and len(REPLICAS) >= 2, "the group size is the number of ps services"
    assert sorted(s.replica for s in settings.values()) == list(range(len(REPLICAS))), "indices 0..R-1, once each"
    assert settings["ps"].replica == 0, "`ps` (what the chaos scripts and e2e address) is replica 0"
    assert {(s.replica_addr, s.replica_port) for s in settings.values()} == {("ps", settings["ps"].replica_port)}, \
        "every replica dials replica 0's service at one port"
    job = JobConfig.build(job_id="compose", preset="tiny", batch_size=4)
    groups = [replica_group(s, job) for s in settings.values()]  # what the PS forms from these settings
    assert sorted((g.replica, g.replicas, g.where) for g in groups) == [(r, len(REPLICAS), "ps:29500")
                                                                        for r in range(len(REPLICAS))]


def test_every_replica_is_the_same_service_but_for_its_index():
    first = REPLICAS["ps"]
    runner = BASE["services"]["runner"]
    for name, service in REPLICAS.items():
        assert build_parser().parse_args(service["command"]).command == "ps"
        for key in SAME_AS_PS:
            assert service[key] == first[key], f"{name}: {key} differs from replica 0's"
        assert "container_name" not in service and "ports" not in service, f"{name} publishes nothing"
        nats_url = service["environment"]["CLEAVE_PS_NATS_URL"]
        assert nats_url == runner["environment"]["CLEAVE_PS_NATS_URL"], f"{name} connects elsewhere"
        assert service["restart"] == "on-failure", "a replica that finished its job stays down"
