"""The pure side of `cleave auth`: permissions per role, the server config, credentials, client options."""

from __future__ import annotations

import argparse
import re
import shutil
import ssl
import subprocess
from pathlib import Path

import nkeys
import pytest

from cleave import auth
from cleave.api import credentials
from cleave.api.natsconf import nats_server_binary
from cleave.errors import ConfigError
from cleave.schemas import PLAN_BUCKET, STATE_BUCKET
from cleave_cli import auth_cmd, serverconf
from cleave_cli.hub import HubConfig
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
    """A worker gets no JetStream at all: it asks the PS for a job's base weights and tokenizer on its own
    subject (`cleave.models.<id>`) and reads the answers in its own inbox."""
    for perms in (auth.permissions("worker"), auth.permissions("worker", "w-1")):
        for subject in perms.publish + perms.subscribe:
            assert subject.startswith(("cleave.", "_INBOX.worker.")), subject
        assert perms.allow_responses  # it answers the PS's fan-out joins, once per request it received
    pinned = auth.permissions("worker", "w-1")
    assert set(pinned.subscribe) == {"cleave.tile.w-1", "cleave.ctl.w-1", "cleave.check.w-1", "cleave.fan.*.*.*", "cleave.round.w-1",
                                      "cleave.roundcast.*", "cleave.split.w-1", "cleave.secagg.w-1", "_INBOX.worker.w-1.>"}
    assert "cleave.hb.w-1" in pinned.publish and "cleave.hb.*" not in pinned.publish
    assert "cleave.models.w-1" in pinned.publish and "cleave.models.*" not in pinned.publish
    assert "cleave.models.*" in auth.permissions("worker").publish  # the shared credential: any id
    ps = auth.permissions("ps")  # the PS answers them, under the workers' inboxes
    assert "cleave.models.*" in ps.subscribe and "_INBOX.worker.>" in ps.publish


def test_below_each_star_a_role_may_subscribe_is_denied_and_nothing_it_may_have() -> None:
    """A literal `>` subscription matches an allowed `*` (nats-server): each `*` pattern's deeper subjects are
    denied, and no deny covers a subject the role's allow list admits."""
    worker = auth.permissions("worker")
    assert "cleave.roundcast.*.>" in worker.subscribe_deny and "cleave.fan.*.*.*.>" in worker.subscribe_deny
    assert "cleave.tile.*.>" in worker.subscribe_deny and "cleave.tile.w1.>" not in auth.permissions(
        "worker", "w1").subscribe_deny  # (a pinned id is one token already)

    def matches(pattern: str, subject: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        if p[-1] == ">":
            return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
        return len(s) == len(p) and all(a in ("*", b) for a, b in zip(p, s, strict=True))

    for role in auth.ROLES:
        perms = auth.permissions(role)
        samples = [a.replace("*", "x").replace(">", "x.y") for a in perms.subscribe]
        assert not [(d, s) for d in perms.subscribe_deny for s in samples if matches(d, s)], role
        text = serverconf._user_block(auth.new_credential(role) if role != auth.SITE else auth.site_credential("s"))
        assert all(d in text for d in perms.subscribe_deny)


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
    assert echo.public in serverconf.server_config([sched], serverconf.ServerOptions())
    pinned = auth.permissions("worker", "w-1")
    assert "cleave.probe.w-1" in pinned.publish and not any(p.startswith("cleave.probe.*") for p in pinned.publish)
    # read back from `auth init`'s folder (`cleave up --auth`, `cleave scheduler --auth`), the echo comes along
    out = tmp_path / "auth"
    init(out)
    written = (out / "scheduler.env").read_text()
    back = credentials.credential(out, "scheduler", "scheduler")
    (echo_back,) = back.companions
    assert f"{auth.PROBE_ECHO_ENV}={echo_back.seed}" in written and echo_back.public in (out / "nats.conf").read_text()
    assert echo_back.permissions == echo.permissions
    assert credentials.role_env(out, "scheduler")[auth.PROBE_ECHO_ENV] == echo_back.seed
    assert echo_back.public in HubConfig.of("127.0.0.1:0", out).server_config(str(tmp_path / "js"), 0, 1 << 20)


def test_a_hub_beyond_this_machine_takes_tls(tmp_path: Path) -> None:
    """An auth folder without a certificate (written without --tls, or one that lost it) served NATS and the
    sites' leaf port in plain text on a public address, credentials and all, without a word."""
    plain, tls = tmp_path / "plain", tmp_path / "tls"
    init(plain)
    init(tls, "--tls", "--host", "hub.example.org")
    assert HubConfig.of("127.0.0.1:0", plain).url.startswith("nats://")  # on the loopback: as it was
    with pytest.raises(ConfigError, match=r"--listen 0.0.0.0 opens NATS beyond this machine, which takes TLS"):
        HubConfig.of("0.0.0.0:0", plain)
    assert HubConfig.of("0.0.0.0:0", tls).url.startswith("tls://")
    (tls / "tls" / "server-key.pem").unlink()
    with pytest.raises(ConfigError, match="has no key beside it"):
        HubConfig.of("0.0.0.0:0", tls)


@pytest.mark.parametrize(("extra", "says"), [
    (["--tls", "--host", "bad host!"], "--host 'bad host!' is not a host name or IP address"),
    (["--tls", "--host", "tls://hub.example.org:4222"], "is not a host name or IP address"),
    (["--tls", "--host", ""], "is not a host name or IP address"),
    (["--host", "hub.example.org"], "names the generated certificate: it goes with --tls"),
])
def test_auth_init_refuses_a_host_no_certificate_should_name(tmp_path: Path, extra: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        init(tmp_path / "auth", *extra)
    assert not (tmp_path / "auth").exists()  # nothing written
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file: the credentials are written into a folder"):
        init(tmp_path / "afile")
    init(tmp_path / "ok", "--tls", "--host", "203.0.113.7", "--host", "hub.example.org", "--host", "::1")


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
    assert [c.name for c in creds] == ["ps", "scheduler", "monitor", "submitter", "worker-w1", "worker-w2"]
    text = serverconf.server_config(creds, serverconf.ServerOptions())
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
    material = serverconf.generate_tls(["cleave.example.org"])
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
    (tmp_path / "ca.pem").write_bytes(serverconf.generate_tls(["localhost"]).ca_pem)
    assert isinstance(auth.connect_options(PsSettings(nats_tls_ca=tmp_path / "ca.pem"), "ps")["tls"], ssl.SSLContext)


def test_a_site_links_exactly_what_its_workers_may_and_the_answers_to_the_ps_requests() -> None:
    site, worker = auth.permissions(auth.SITE), auth.permissions("worker")
    assert set(site.subscribe) == set(worker.subscribe)
    assert set(site.publish) == {*worker.publish, "_INBOX.ps.w.>"}  # never another reply of the PS's
    assert not site.allow_responses  # it does not cross a leaf node: the answers are listed instead
    # no JetStream at all: its workers ask the PS for a job's base weights and tokenizer, the answers come back
    assert not [s for s in site.publish + site.subscribe if s.startswith(("$JS", "$KV", "$O", "cleave.events"))]
    assert "cleave.models.*" in site.publish and "_INBOX.worker.>" in site.subscribe


def test_the_submitter_submits_and_reads_and_writes_nothing_else() -> None:
    sub = auth.permissions(auth.SUBMITTER)
    writes = [s for s in sub.publish if not s.startswith("$JS.API.") and not s.startswith(("$JS.FC.", "$JS.ACK."))]
    assert writes == ["cleave.jobs.submit.*"]
    assert not [s for s in sub.publish if ".PURGE." in s or ".DELETE." in s and "CONSUMER" not in s]
    assert sub.subscribe == ("_INBOX.submitter.>",)
    assert "$KV.cleave-jobs.>" in auth.permissions("ps").publish  # the runner (as the PS) alone writes job records
    assert not [r for r in ("scheduler", "monitor", "worker", auth.SITE, auth.SUBMITTER)
                if "$KV.cleave-jobs.>" in auth.permissions(r).publish]


def test_the_monitor_reads_events_and_its_replies_and_nothing_live_else() -> None:
    """It never read the heartbeats it was allowed (workers' ids and profiles, live): least privilege."""
    assert set(auth.permissions("monitor").subscribe) == {"cleave.events.>", "_INBOX.monitor.>"}


def test_sites_and_a_cluster_in_the_written_config(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    written = init(out, "--tls", "--sites", "lab-a,lab-b", "--cluster", "n1,n2:16222,n3")
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(out / "nats.conf")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (out / "nats.conf").read_text()
    assert text.count('allowed_connection_types: ["LEAFNODE"]') == 2  # the sites' keys make leaf links only
    # ps, scheduler and its probe echo, monitor, submitter, worker, and the operators' admin
    assert text.count('allowed_connection_types: ["STANDARD"]') == 7
    assert 'listen: "0.0.0.0:7422"' in text and "verify: true" in text
    assert '"nats-route://n2:16222"' in text and '"nats-route://n1:6222"' in text
    for site in ("lab-a", "lab-b"):
        folder = out / "sites" / site
        assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "site.env", "worker.env"]
        assert (folder / "site.env").stat().st_mode & 0o777 == 0o600 and folder / "site.env" in written
        cred = credentials.credential(folder, "site", auth.SITE)
        assert cred.public in text and cred.seed not in text
    assert (out / "sites" / "lab-a" / "site.env").read_text() != (out / "sites" / "lab-b" / "site.env").read_text()
    with pytest.raises(ConfigError, match="--tls"):
        init(tmp_path / "plain", "--cluster", "n1,n2,n3")
    with pytest.raises(ConfigError, match="site name"):
        init(tmp_path / "bad", "--sites", "a.b")
    # a site's link receives every worker id's tiles, which would undo the pinning
    with pytest.raises(ConfigError, match="--sites and --worker-ids do not go together"):
        init(tmp_path / "pinned", "--sites", "lab-a", "--worker-ids", "w1,w2")
    assert not (tmp_path / "pinned").exists()  # refused before anything is written


def test_each_site_gets_a_worker_key_of_its_own_that_the_hub_does_not_list(tmp_path: Path) -> None:
    """A site's folder held the hub's shared worker seed: deleting the folder did not revoke the site (it logged
    in on the hub's client port as any worker), and every site learned the key of the hub's own workers."""
    out = tmp_path / "auth"
    written = init(out, "--sites", "lab-a,lab-b")
    shared = credentials.credential(out, "worker", "worker")
    own = {s: credentials.credential(out / "sites" / s, "worker", "worker") for s in ("lab-a", "lab-b")}
    assert len({shared.seed, *(c.seed for c in own.values())}) == 3
    for site in own:
        path = out / "sites" / site / auth_cmd.WORKER_ENV
        assert path in written and path.stat().st_mode & 0o777 == 0o600
    assert own["lab-a"].permissions == shared.permissions  # a worker's rights, at its own leaf node
    text = (out / "nats.conf").read_text()
    assert shared.public in text and not [c for c in own.values() if c.public in text]
    hub = HubConfig.of("127.0.0.1:0", out)  # `cleave up --auth`: the users it derives from the folder
    assert shared.public in {c.public for c in hub.creds}
    assert not {c.public for c in hub.creds} & {c.public for c in own.values()}
    assert hub.sites_with_hub_keys() is None


def test_a_hub_warns_of_a_site_folder_that_holds_its_shared_worker_key(tmp_path: Path) -> None:
    """A site folder written before sites had keys of their own holds the hub's worker.env: `cleave site` still
    runs with it, and the hub says at each start that deleting it does not revoke the site, and what to do."""
    out = tmp_path / "auth"
    init(out, "--sites", "lab-a,lab-b")
    shutil.copy(out / "worker.env", out / "sites" / "lab-b" / auth_cmd.WORKER_ENV)
    said = HubConfig.of("127.0.0.1:0", out).sites_with_hub_keys()
    assert said is not None and said.startswith("site lab-b was given this hub's shared worker key"), said
    assert "lab-a" not in said and f"cleave auth init --force --out {out}" in said
    shutil.rmtree(out / "sites" / "lab-b")  # revoked as documented: it still holds the key, and is still told of
    assert HubConfig.of("127.0.0.1:0", out).sites_with_hub_keys() == said
    init(out, "--sites", "lab-a", "--force")  # every credential re-issued: the key it holds is no login now
    assert HubConfig.of("127.0.0.1:0", out).sites_with_hub_keys() is None


def test_a_leaf_node_holds_the_site_seed_and_verifies_the_hub(tmp_path: Path) -> None:
    site, worker = auth.site_credential("lab-a"), auth.new_credential("worker")
    (tmp_path / "ca.pem").write_bytes(serverconf.generate_tls(["hub.example.org"]).ca_pem)
    opts = serverconf.LeafOptions(name="lab-a", listen="0.0.0.0:4222", http="127.0.0.1:8222",
                                  hubs=("tls://hub.example.org:7422",), ca_file=str(tmp_path / "ca.pem"))
    text = serverconf.leaf_config(site, worker, opts)
    assert site.seed in text and worker.public in text and worker.seed not in text
    assert f'ca_file: "{tmp_path / "ca.pem"}"' in text
    (tmp_path / "leaf.conf").write_text(text)
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "leaf.conf")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(ConfigError, match="site and a worker"):
        serverconf.leaf_config(worker, worker, opts)


def test_a_hub_on_every_address_says_when_its_certificate_does_not_name_the_sites_address(tmp_path: Path) -> None:
    """`cleave up --listen 0.0.0.0 --auth` prints `sites dial tls://<this machine's name>:7422`: a certificate
    made without --host for that name failed every site that followed the line, and the hub said nothing."""
    import socket  # noqa: PLC0415

    name = socket.gethostname()
    bare, named = tmp_path / "bare", tmp_path / "named"
    init(bare, "--tls", "--host", "hub.example.org")
    init(named, "--tls", "--host", name)
    said = HubConfig.of("0.0.0.0:0", bare).leaf_unnamed()
    assert said is not None and f"not {name}: sites dial one of its names" in said and "hub.example.org" in said
    assert f"cleave auth init --tls --host {name}" in said
    assert HubConfig.of("0.0.0.0:0", named).leaf_unnamed() is None
    assert HubConfig.of("hub.example.org:0", bare).leaf_unnamed() is None  # the address it was made for
    assert HubConfig.of("127.0.0.1:0", bare).leaf_unnamed() is None  # (always named: localhost, 127.0.0.1, nats)
