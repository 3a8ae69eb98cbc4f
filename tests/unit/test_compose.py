"""The compose files, read as data (no Docker engine here): services, commands, settings, scaling, health.

Every command a container runs must parse with the real `cleave` parser, every environment variable must
be read by something (a settings field, the logging setup, or compose itself), and `.env.example` must
list every setting of every service. The hub runs no job of its own: jobs come through its runner.
"""

from __future__ import annotations

import argparse
import fnmatch
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cleave.api.natsconf import nats_server_binary
from cleave.api.stack import DEFAULT_STOP_GRACE_S
from cleave.runtime import config_file, logs
from cleave_cli import auth_cmd
from cleave_cli.main import build_parser
from cleave_monitor.settings import MonitorSettings
from cleave_ps.settings import PsSettings
from cleave_scheduler.settings import SchedulerSettings
from cleave_worker.settings import WorkerSettings

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
SETTINGS = {"ps": PsSettings, "scheduler": SchedulerSettings, "worker": WorkerSettings, "monitor": MonitorSettings}
ROLES = tuple(SETTINGS)  # the settings each service reads (the runner, and each PS it starts, read the PS's)
SERVICES = {"runner": "ps", "scheduler": "scheduler", "worker": "worker", "monitor": "monitor"}  # service -> role
INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")
ENV_LINE = re.compile(r"^#?\s*(CLEAVE_[A-Z0-9_]+)=")


def load(name: str) -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def resolve(value):
    """Compose interpolation with every variable unset: `${NAME:-default}` becomes its default."""
    if isinstance(value, str):
        return INTERPOLATION.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [resolve(v) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v) for k, v in value.items()}
    return value


BASE = resolve(load("docker-compose.yml"))
AUTH = resolve(load("docker-compose.auth.yml"))


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def settings_env(role: str) -> set[str]:
    cls = SETTINGS[SERVICES.get(role, role)]
    return {cls.model_config["env_prefix"] + name.upper() for name in cls.model_fields}


def env_names(service: dict) -> set[str]:
    env = service.get("environment", {})
    return set(env) if isinstance(env, dict) else {e.split("=", 1)[0] for e in env}


def compose_variables() -> set[str]:
    text = "".join(p.read_text() for p in COMPOSE.glob("docker-compose*.yml"))
    return {m.group(1) for m in INTERPOLATION.finditer(text)}


def test_the_services() -> None:
    assert set(BASE["services"]) == {"nats", *SERVICES}, "a hub: no PS with a job of its own"
    assert set(AUTH["services"]) <= set(BASE["services"])


@pytest.mark.parametrize("role", SERVICES)
def test_commands_exist_in_the_cli(role: str) -> None:
    command = BASE["services"][role]["command"]
    assert command[0] == role
    try:
        args = build_parser().parse_args(command)
    except SystemExit:
        pytest.fail(f"`cleave {' '.join(command)}` does not parse: is `cleave {role}` wired into build_parser()?")
    assert args.command == role


def test_the_image_runs_cleave_as_an_unprivileged_user() -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["cleave"\]$', dockerfile, re.M), "exec-form entrypoint, so cleave gets SIGTERM"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)  # the public image by default
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^torch==\S+$", (COMPOSE.parent / "constraints" / "cpu.txt").read_text(), re.M)
    assert "COPY constraints constraints" in dockerfile and "-c constraints/cpu.txt ." in dockerfile, \
        "the image installs the torch the README's commands pin (constraints/cpu.txt)"
    for role in SERVICES:
        build = BASE["services"][role]["build"]
        assert (COMPOSE / build["context"] / build["dockerfile"]).resolve() == (COMPOSE / "Dockerfile").resolve()


@pytest.mark.parametrize("path", ["docker-compose.yml", "docker-compose.auth.yml"])
def test_every_environment_variable_is_read_by_its_service(path: str) -> None:
    for name, service in resolve(load(path))["services"].items():
        for var in env_names(service):
            assert name in SERVICES and var in settings_env(name), f"{path}: {name} sets {var}, which nothing reads"


def test_env_example_lists_every_setting_and_nothing_else() -> None:
    listed = [m.group(1) for line in (COMPOSE / ".env.example").read_text().splitlines()
              if (m := ENV_LINE.match(line))]
    assert len(listed) == len(set(listed)), "a name is listed twice"
    known = set().union(*(settings_env(r) for r in ROLES))
    logging_vars = set(re.findall(r'"(CLEAVE_LOG_[A-Z_]+)"', inspect.getsource(logs)))
    compose_vars = {v for v in compose_variables() if v.startswith("CLEAVE_COMPOSE_")}
    known.add(config_file.CONFIG_ENV)  # the settings file every service reads its table of
    assert set(listed) - known - logging_vars - compose_vars == set(), "listed but read by nothing"
    assert known - set(listed) == set(), "settings missing from .env.example"
    assert compose_vars - set(listed) == set(), "compose variables missing from .env.example"


def test_workers_scale() -> None:
    worker = BASE["services"]["worker"]
    assert "container_name" not in worker, "a fixed name allows one replica only"
    assert "ports" not in worker, "a fixed host port allows one replica only; workers only dial out"
    assert int(worker["deploy"]["replicas"]) >= 1
    assert "CLEAVE_WORKER_WORKER_ID" not in env_names(worker), "replicas would share one id"
    for service in AUTH["services"].values():
        assert "container_name" not in service


def test_every_published_port_binds_the_loopback_unless_told_otherwise() -> None:
    """Least privilege by default: what a compose file publishes listens on 127.0.0.1 until its *_BIND
    variable says otherwise (the hub's client and leaf ports, the site's, the dashboard); NATS monitoring
    (8222) is never published, and workers publish nothing (`test_workers_scale`)."""
    published = 0
    for path in sorted(COMPOSE.glob("docker-compose*.yml")):
        for name, service in (resolve(yaml.safe_load(path.read_text())).get("services") or {}).items():
            for port in service.get("ports", []):
                published += 1
                host, _, target = str(port).rpartition(":")
                assert host.startswith("127.0.0.1:"), f"{path.name}: {name} publishes {port} beyond the loopback"
                assert target != "8222", f"{path.name}: {name} publishes NATS monitoring"
    assert published >= 4  # the hub's NATS, leaf port and dashboard, the site's leaf node


def test_lifecycle_health_and_start_order() -> None:
    services = BASE["services"]
    for role in SERVICES:
        s = services[role]
        assert s["restart"] in ("unless-stopped", "always", "on-failure"), role
        assert seconds(s["stop_grace_period"]) > DEFAULT_STOP_GRACE_S, f"{role} is killed mid-drain"
        assert s["depends_on"]["nats"]["condition"] == "service_healthy", role
    assert services["runner"]["restart"] == "unless-stopped", "the runner waits for jobs; a finished job stays done"
    runs = {v.split(":")[1]: v.split(":")[0] for v in services["runner"]["volumes"]}
    run_dir = services["runner"]["command"][services["runner"]["command"].index("--run-dir") + 1]
    assert any(run_dir.startswith(t) and src in BASE["volumes"] for t, src in runs.items()), "jobs' files on a volume"
    assert "install -d -o cleave -g cleave /home/cleave/runs" in (COMPOSE / "Dockerfile").read_text()
    for name in ("nats", "monitor"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    assert "/healthz" in " ".join(services["nats"]["healthcheck"]["test"])
    assert services["nats"]["restart"] == "unless-stopped"


def test_nats_keeps_jetstream_on_a_named_volume_and_fsyncs() -> None:
    nats = BASE["services"]["nats"]
    named = [v.split(":")[0] for v in nats["volumes"] if not v.startswith((".", "/"))]
    assert named and set(named) <= set(BASE["volumes"])
    conf = (COMPOSE / "nats" / "nats.conf").read_text()
    assert re.search(r"^\s*sync_interval:\s*always\s*$", conf, re.M)
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    store = re.search(r'store_dir:\s*"([^"]+)"', conf).group(1)
    assert any(store.startswith(target) for target, src in mounted.items() if src in named), "store not on the volume"
    assert "8222" in conf, "the health check needs the monitoring port"


def test_the_nats_config_parses() -> None:
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(COMPOSE / "nats" / "nats.conf")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_auth_override_matches_what_auth_init_writes(tmp_path: Path) -> None:
    services = AUTH["services"]
    for name, role in SERVICES.items():
        files = [e["path"] if isinstance(e, dict) else e for e in services[name]["env_file"]]
        assert f"./auth/{role}.env" in files, name  # the runner logs in as the PS
        tls_ca = SETTINGS[role].model_config["env_prefix"] + "NATS_TLS_CA"
        mounted = {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
        assert mounted[services[name]["environment"][tls_ca]] == f"./auth/{auth_cmd.TLS_DIR}/{auth_cmd.CA_NAME}"
        assert services[name]["environment"][SETTINGS[role].model_config["env_prefix"] + "NATS_URL"].startswith("tls://")
    assert [p.rsplit(":", 1)[1] for p in services["nats"]["ports"]] == ["7422"], "the sites' leaf-node port"
    nats = services["nats"]
    config = nats["command"][nats["command"].index("--config") + 1]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    assert mounted[config] == f"./auth/{auth_cmd.CONFIG_NAME}"
    assert not any(src.endswith(".env") or src == "./auth" for src in mounted.values()), "seeds stay out of nats"
    # every file the override mounts or reads is one `cleave auth init --out auth --tls` writes
    args = build_auth_parser().parse_args(["auth", "init", "--out", str(tmp_path / "auth"), "--tls", "--sites", "a"])
    auth_cmd.init(args)
    wanted = {src for s in services.values() for src in (v.split(":")[0] for v in s.get("volumes", []))}
    wanted |= {e["path"] if isinstance(e, dict) else e for s in services.values() for e in s.get("env_file", [])}
    text = (tmp_path / "auth" / auth_cmd.CONFIG_NAME).read_text()
    assert 'listen: "0.0.0.0:7422"' in text, "with --sites the config listens for leaf nodes where compose publishes"
    for rel in wanted - {".env"}:
        assert (tmp_path / rel).exists(), f"docker-compose.auth.yml uses {rel}, which auth init does not write"


def build_auth_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cleave")
    auth_cmd.register(parser.add_subparsers(dest="command"))
    return parser


def test_chaos_scripts_cover_every_scenario_and_parse():
    """The container chaos scripts exist for kill (bringing the victim back), freeze/thaw and restart."""
    import subprocess
    from pathlib import Path

    chaos = Path(__file__).resolve().parents[2] / "compose" / "chaos"
    for name in ("kill.sh", "freeze.sh", "restart.sh", "lib.sh", "../e2e/engine.sh", "../e2e/chaos-check.sh"):
        script = chaos / name
        assert script.exists(), name
        subprocess.run(["bash", "-n", str(script)], check=True)
    kill = (chaos / "kill.sh").read_text()
    assert "docker kill" in kill and "docker start" in kill  # docker kill bypasses restart policies
    assert "compose up" not in kill  # `up` resets `--scale worker=N` to deploy.replicas (e2e/chaos-check.sh)
    assert "docker pause" in (chaos / "freeze.sh").read_text()


def test_every_file_the_image_copies_is_in_its_build_context() -> None:
    """Each COPY source of the Dockerfile is let through by its .dockerignore (`**` then `!pattern` lines): a
    source left out fails the build only under docker, minutes into the compose end-to-end run."""
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    allowed = [line[1:].strip() for line in (COMPOSE / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.M) for src in line.split()[:-1]]
    assert sources
    for src in sources:
        assert any(fnmatch.fnmatch(src, p) or fnmatch.fnmatch(f"{src}/x", p) for p in allowed), \
            f"COPY {src}: excluded by compose/Dockerfile.dockerignore"
        assert (COMPOSE.parent / src).exists(), src
    # the end-to-end run without a registry builds from a context of its own (compose/e2e/engine.sh's tar)
    engine = (COMPOSE / "e2e" / "engine.sh").read_text().replace("\\\n", " ")
    tar = re.search(r'tar -C "\$here"[^|]*? -c ([^|]+)\|', engine)
    assert tar, "compose/e2e/engine.sh builds its context with tar"
    packed = tar.group(1).split()
    for src in sources:
        assert any(src == p or src.startswith(p + "/") for p in packed), f"COPY {src}: not in engine.sh's context"
