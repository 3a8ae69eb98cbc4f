"""The pure side of `cleave auth`: permissions per role, the server config, credentials, client options."""

from __future__ import annotations

import argparse
import ssl
import subprocess
from pathlib import Path

import nkeys
import pytest

from cleave import auth
from cleave.errors import ConfigError
from cleave.schemas import PLAN_BUCKET, STATE_BUCKET
from cleave_cli import auth_cmd
from cleave_cli.natsconf import nats_server_binary
from cleave_ps.settings import PsSettings
from cleave_worker.settings import WorkerSettings


def init(out: Path, *extra: str) -> list[Path]:
    parser = argparse.ArgumentParser()
    auth_cmd.register(parser.add_subparsers(dest="command"))
    return auth_cmd.init(parser.parse_args(["auth", "init", "--out", str(out), "--store-dir", str(out / "js"), *extra]))


def test_only_the_owner_publishes_tiles_plans_and_state() -> None:
    owners = {"cleave.tile.*": "ps", f"$KV.{PLAN_BUCKET}.>": "scheduler", f"$KV.{STATE_BUCKET}.>": "ps"}
    for role in auth.ROLES:
        publish = auth.permissions(role).publish
        for subject, owner in owners.items():
            assert (subject in publish) == (role == owner), (role, subject)


def test_a_worker_gets_no_jetstream_and_only_its_own_replies() -> None:
    for perms in (auth.permissions("worker"), auth.permissions("worker", "w-1")):
        for subject in perms.publish + perms.subscribe:
            assert subject.startswith(("cleave.", "_INBOX.worker.")), subject
        assert perms.allow_responses  # it answers the PS's fan-out joins, once per request it received
    pinned = auth.permissions("worker", "w-1")
    assert set(pinned.subscribe) == {"cleave.tile.w-1", "cleave.ctl.w-1", "cleave.check.w-1", "cleave.fan.*.*.*", "cleave.round.w-1",
                                      "cleave.roundcast.*", "cleave.split.w-1", "_INBOX.worker.w-1.>"}
    assert "cleave.hb.w-1" in pinned.publish and "cleave.hb.*" not in pinned.publish


def test_each_service_reads_replies_under_its_own_prefix_only() -> None:
    for role in auth.SERVICE_ROLES:
        inboxes = [s for s in auth.permissions(role).subscribe if s.startswith("_INBOX")]
        assert inboxes == [f"_INBOX.{role}.>"]
        assert not auth.permissions(role).allow_responses  # only workers answer (the PS's joins and checks)


def test_probes_are_answered_by_a_credential_that_may_publish_nowhere_else(tmp_path: Path) -> None:
    """A request names its own reply subject: the scheduler's probe echo has a credential of its own that may
    publish only into the workers' inboxes, so no reply can reach a bucket or the JetStream API."""
    sched = auth.new_credential("scheduler")
    (echo,) = sched.companions
    assert echo.name == auth.PROBE_ECHO and echo.env_var == "CLEAVE_SCHEDULER_PROBE_NKEY_SEED"
    assert echo.permissions.publish == ("_INBOX.worker.>",) and not echo.permissions.allow_responses
    assert echo.permissions.subscribe == ("cleave.probe.*",)
    assert "cleave.probe.*" not in sched.permissions.subscribe  # the scheduler's own credential reads no probe
    assert f"{echo.env_var}={echo.seed}" in auth.env_text(sched) and sched.seed in auth.env_text(sched)
    assert echo.public in auth.server_config([sched], auth.ServerOptions())
    pinned = auth.permissions("worker", "w-1")
    assert "cleave.probe.w-1" in pinned.publish and not any(p.startswith("cleave.probe.*") for p in pinned.publish)


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "x" * 129, "w 1"])
def test_worker_ids_that_would_widen_a_subject_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="worker id"):
        auth.permissions("worker", bad)


def test_unknown_roles_and_duplicate_ids_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown role"):
        auth.permissions("admin")
    with pytest.raises(ConfigError, match="twice"):
        auth.credentials(("w1", "w1"))


def test_credentials_are_real_nkeys_and_the_config_holds_no_seed() -> None:
    creds = auth.credentials(("w1", "w2"))
    assert [c.name for c in creds] == ["ps", "scheduler", "monitor", "worker-w1", "worker-w2"]
    text = auth.server_config(creds, auth.ServerOptions())
    for c in creds:
        assert nkeys.from_seed(bytearray(c.seed.encode())).public_key.decode() == c.public
        assert c.public in text and c.seed not in text
    assert "sync_interval: always" in text
    assert len({c.seed for c in creds}) == len(creds)


def test_the_written_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    init(tmp_path / "auth", "--tls", "--host", "nats.example.org", "--worker-ids", "a,b")
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "auth" / "nats.conf")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_secrets_are_written_private_and_never_overwritten_by_accident(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    written = init(out, "--tls")
    for path in written:
        private = path.suffix in (".env", ".nk") or path.name == auth_cmd.KEY_NAME
        assert (path.stat().st_mode & 0o777) == (0o600 if private else 0o644), path
    seed = (out / "worker.env").read_text()
    with pytest.raises(ConfigError, match="--force"):
        init(out)
    assert (out / "worker.env").read_text() == seed
    init(out, "--force")
    assert (out / "worker.env").read_text() != seed


def test_a_provided_certificate_is_used(tmp_path: Path) -> None:
    material = auth.generate_tls(["cleave.example.org"])
    for name, data in (("c.pem", material.cert_pem), ("k.pem", material.key_pem), ("ca.pem", material.ca_pem)):
        (tmp_path / name).write_bytes(data)
    out = tmp_path / "auth"
    init(out, "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"),
         "--tls-ca", str(tmp_path / "ca.pem"))
    assert (out / "tls" / auth_cmd.CERT_NAME).read_bytes() == material.cert_pem
    assert f'cert_file: "{(out / "tls" / auth_cmd.CERT_NAME).resolve().as_posix()}"' in (out / "nats.conf").read_text()
    with pytest.raises(ConfigError, match="go together"):
        init(tmp_path / "other", "--tls-cert", str(tmp_path / "c.pem"))


def test_connect_options_from_settings(tmp_path: Path) -> None:
    cred = auth.new_credential("worker")
    opts = auth.connect_options(WorkerSettings(worker_id="w-1", nats_nkey_seed=cred.seed), "worker")
    assert opts == {"inbox_prefix": "_INBOX.worker.w-1", "nkeys_seed_str": cred.seed}
    assert cred.seed not in repr(WorkerSettings(nats_nkey_seed=cred.seed))  # logged settings stay masked
    opts = auth.connect_options(PsSettings(nats_user="ps", nats_password="pw"), "ps")
    assert (opts["user"], opts["password"]) == ("ps", "pw")
    assert auth.connect_options(PsSettings(), "ps") == {"inbox_prefix": "_INBOX.ps"}
    with pytest.raises(ConfigError, match="not both"):
        auth.connect_options(PsSettings(nats_user="ps", nats_nkey_seed=cred.seed), "ps")
    with pytest.raises(ConfigError, match="NKEY_SEED"):
        auth.connect_options(PsSettings(nats_nkey_seed="UABC"), "ps")  # a public key pasted as the seed
    with pytest.raises(ConfigError, match="NATS_TLS_CA"):
        auth.connect_options(PsSettings(nats_tls_ca=tmp_path / "missing.pem"), "ps")
    (tmp_path / "ca.pem").write_bytes(auth.generate_tls(["localhost"]).ca_pem)
    assert isinstance(auth.connect_options(PsSettings(nats_tls_ca=tmp_path / "ca.pem"), "ps")["tls"], ssl.SSLContext)
