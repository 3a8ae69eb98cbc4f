"""The promises of docs/security.md about roles, streams, replies, leaf logins, TLS names and revocation, each
tried against a real nats-server running the config `cleave auth init` wrote, with the credentials it issued.

Every test tries the forbidden thing with the real credential and sees it refused (the connect raises, or the
server names the subject in a permissions violation, `authserver.Client.violation`), and does the allowed
counterpart the docs promise, so that it cannot pass because nothing worked at all. Leaf nodes are real
nats-servers dialling the hub's leaf-node port with `serverconf.leaf_config`.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest
from cryptography import x509

from cleave import auth
from cleave.api import credentials
from cleave.api.natsconf import free_port, nats_server_binary
from cleave.api.topology import get_json
from cleave.bus import Bus
from cleave.errors import CleaveError
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    JOBS_STREAM,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    STATE_BUCKET,
    STATE_OBJECTS,
    SUBJECT_HEARTBEAT,
    SUBJECT_JOB_SUBMIT,
    SUBJECT_TILES,
    WORKER_REPLY_TOKEN,
)
from cleave_cli import auth_cmd, serverconf
from cleave_cli.hub import HubConfig
from cleave_cli.runner import jobs_stream
from cleave_ps.settings import PsSettings
from tests.integration import authserver
from tests.integration.authserver import (
    OP_TIMEOUT_S,
    READY_TIMEOUT_S,
    AuthServer,
    Client,
    heartbeat,
    launch,
    refused,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.timeout(60)
server, pinned_server, connect = authserver.server, authserver.pinned_server, authserver.connect  # fixtures
STATE, PLANS = f"KV_{STATE_BUCKET}", f"KV_{PLAN_BUCKET}"  # the buckets' streams
CLIENT_ROLES = ("ps", "scheduler", "monitor", "submitter", "worker")  # every role that logs in as a client


# ---- helpers -------------------------------------------------------------------------------------------
async def refuses(client: Client, kind: str, subjects: list[str], data: bytes = b"forged") -> None:
    """Try each subject (`kind` "publish", with a reply like a real request, or "subscription") and wait for the
    server's permissions violation naming it."""
    for s in subjects:
        if kind == "publish":
            await client.nc.publish(s, data, reply=client.nc.new_inbox())
        else:
            await client.nc.subscribe(s)
    for s in subjects:
        await client.violation(f'{kind} to "{s}"')


async def clients(srv: AuthServer, connect, roles=CLIENT_ROLES) -> dict[str, Client]:
    """One connection per role (and the scheduler's probe echo, `scheduler-probe`), each with its credential."""
    got = {role: await connect(srv.settings(role), role) for role in roles}
    if "scheduler" in roles:
        got[auth.PROBE_ECHO] = await connect(srv.probe_echo(), "scheduler")
    return got


@pytest.fixture
async def admin() -> AsyncIterator:
    """`admin.nk`'s connections (the operators' unrestricted credential), closed at the end."""
    ncs: list[nats.NATS] = []

    async def make(srv: AuthServer) -> nats.NATS:
        nc = await nats.connect(srv.url, nkeys_seed_str=srv.admin_seed(), allow_reconnect=False,
                                connect_timeout=OP_TIMEOUT_S)
        ncs.append(nc)
        return nc

    yield make
    for nc in ncs:
        await nc.close()


async def setup_streams(srv: AuthServer, connect) -> Bus:
    """The streams and buckets as the PS and the hub's runner create them; the PS's Bus."""
    ps = Bus((await connect(srv.settings("ps"), "ps")).nc, "ps")
    await ps.setup()
    await jobs_stream(ps)
    return ps


# ---- 1. the submitter --------------------------------------------------------------------------------
async def test_a_submitter_cannot_touch_the_fleet_the_plan_or_another_roles_state(server, connect) -> None:
    """security.md:17 and :39: a submitter submits jobs and reads the job records, step metrics and the PS's
    state (export); it cannot publish tiles, plans, state or events, read results, tiles or heartbeats, or read
    the plan or the registry."""
    ps = await setup_streams(server, connect)
    state = await ps.kv(STATE_BUCKET, history=5)
    await state.put("j.head", b"honest")
    await (await ps.kv(JOBS_BUCKET)).put("j", b"record")  # what the runner writes
    victim = await connect(server.settings("worker"), "worker")  # a worker waiting for its tiles
    tiles = await victim.nc.subscribe(SUBJECT_TILES.format(worker_id="w1"))
    await victim.nc.flush(timeout=OP_TIMEOUT_S)
    sub = await connect(server.settings(auth.SUBMITTER), auth.SUBMITTER)

    # allowed: a submission is stored in the jobs stream; the job records, the step metrics (events) and the
    # PS's state can be read (cleave status, cleave export)
    js = sub.nc.jetstream()
    ack = await js.publish(SUBJECT_JOB_SUBMIT.format(job="j"), b"{}", timeout=OP_TIMEOUT_S)
    assert ack.stream == JOBS_STREAM
    records = await js.key_value(JOBS_BUCKET)
    assert (await records.get("j")).value == b"record"
    assert (await js.stream_info(EVENTS_STREAM)).config.name == EVENTS_STREAM
    readable = await js.key_value(STATE_BUCKET)
    assert (await readable.get("j.head")).value == b"honest"
    assert sub.errors == []

    forged_pub = [
        SUBJECT_TILES.format(worker_id="w1"), "cleave.fan.j.1.g", "cleave.roundcast.j", "cleave.round.w1",
        f"$KV.{PLAN_BUCKET}.{PLAN_KEY}", f"$KV.{PLAN_BUCKET}.{SHAPES_KEY}",  # the plan
        f"$KV.{STATE_BUCKET}.j.head", f"$O.{STATE_OBJECTS}.M.weights",  # the PS's state
        f"$KV.{REGISTRY_BUCKET}.w1", f"$KV.{JOBS_BUCKET}.j",  # the registry, the job records
        "cleave.events.metrics.j", "cleave.result.j.1.w1", SUBJECT_HEARTBEAT.format(worker_id="w1"),
        f"$JS.API.STREAM.PURGE.{STATE}", f"$JS.API.STREAM.MSG.DELETE.{STATE}",
        f"$JS.API.STREAM.CREATE.{EVENTS_STREAM}",
        # reading the plan or the registry: stream info, message get, a consumer
        f"$JS.API.STREAM.INFO.{PLANS}", f"$JS.API.DIRECT.GET.{PLANS}.$KV.{PLAN_BUCKET}.{PLAN_KEY}",
        f"$JS.API.STREAM.MSG.GET.{PLANS}", f"$JS.API.CONSUMER.CREATE.{PLANS}",
        f"$JS.API.STREAM.INFO.KV_{REGISTRY_BUCKET}", f"$JS.API.CONSUMER.CREATE.KV_{REGISTRY_BUCKET}",
    ]
    forged_sub = ["cleave.result.*.*.*", "cleave.update.*.*.*", "cleave.tile.*", "cleave.hb.*", "cleave.probe.*",
                  "cleave.models.*", "cleave.events.>", "cleave.jobs.submit.*", "$KV.>", "_INBOX.ps.>", ">"]
    await refuses(sub, "publish", forged_pub)
    await refuses(sub, "subscription", forged_sub)
    assert len(sub.errors) == len(forged_pub) + len(forged_sub)  # each refused once, nothing else
    assert sub.nc.is_connected

    await victim.nc.flush(timeout=OP_TIMEOUT_S)
    assert tiles.pending_msgs == 0  # the forged tile reached no worker
    assert (await readable.get("j.head")).value == b"honest" and (await readable.status()).values == 1
    assert (await records.get("j")).value == b"record" and (await records.status()).values == 1
    plans = await ps.kv(PLAN_BUCKET, history=5)
    assert (await plans.status()).values == 0  # no plan and no shapes were written


# ---- 2. no role deletes or updates a stream ----------------------------------------------------------
async def test_no_role_may_delete_or_update_a_stream(server, connect, admin) -> None:
    """security.md:52-54: no role may delete or update a stream; only the operators' admin.nk may (the same
    requests, sent with it, take effect)."""
    await setup_streams(server, connect)
    root = await admin(server)
    js = root.jetstream()
    streams = (EVENTS_STREAM, STATE, PLANS, JOBS_STREAM)
    updates = {}
    for name in streams:
        config = (await js.stream_info(name)).config.as_dict()
        updates[name] = json.dumps({**config, "max_msgs": 7}).encode()
    roles = await clients(server, connect)
    for role, client in roles.items():
        for name in streams:
            await refuses(client, "publish", [f"$JS.API.STREAM.UPDATE.{name}"], updates[name])
            await refuses(client, "publish", [f"$JS.API.STREAM.DELETE.{name}"], b"")
        assert len(client.errors) == 2 * len(streams), (role, client.errors)
    for name in streams:  # still there, unchanged
        assert (await js.stream_info(name)).config.max_msgs != 7

    # the same requests with admin.nk work: an update, then a deletion
    answer = json.loads((await root.request(f"$JS.API.STREAM.UPDATE.{STATE}", updates[STATE],
                                            timeout=OP_TIMEOUT_S)).data)
    assert "error" not in answer and (await js.stream_info(STATE)).config.max_msgs == 7
    answer = json.loads((await root.request(f"$JS.API.STREAM.DELETE.{EVENTS_STREAM}", b"", timeout=OP_TIMEOUT_S)).data)
    assert answer.get("success") is True, answer
    assert EVENTS_STREAM not in {s.config.name for s in await js.streams_info()}


# ---- 3. the PS's replies -----------------------------------------------------------------------------
async def test_no_other_role_reads_the_ps_jetstream_replies(server, connect, admin) -> None:
    """security.md:54-56: each service reads replies under its own prefix, so the monitor, the scheduler, the
    submitter (and a worker) can neither subscribe to the PS's `_INBOX.ps.>` nor receive what is published there,
    while each gets what is published under its own prefix."""
    ps_c = await connect(server.settings("ps"), "ps")
    ps = Bus(ps_c.nc, "ps")
    await ps.setup()
    root = await admin(server)
    at_ps = await root.subscribe("_INBOX.ps.>")  # what is published under the PS's prefix
    await root.flush(timeout=OP_TIMEOUT_S)
    readers = {role: await connect(server.settings(role), role) for role in ("monitor", "scheduler", "submitter", "worker")}
    own, others = {}, {}
    for role, client in readers.items():
        own[role] = await client.nc.subscribe(f"_INBOX.{role}.>")  # its own replies
        others[role] = []
        for subject in ("_INBOX.ps.>", "_INBOX.*.>", "_INBOX.>", ">"):
            others[role].append(await client.nc.subscribe(subject))
            await client.violation(f'subscription to "{subject}"')
        await client.nc.flush(timeout=OP_TIMEOUT_S)

    info = await ps.js.stream_info(EVENTS_STREAM)  # a JetStream answer, published under _INBOX.ps.
    assert info.config.name == EVENTS_STREAM
    await root.publish("_INBOX.ps.x.leak", b"secret")
    await root.publish(f"_INBOX.ps.{WORKER_REPLY_TOKEN}.abc.def", b"secret")  # where a site may answer
    for role in readers:  # a sentinel under each role's own prefix, after everything above
        await root.publish(f"_INBOX.{role}.sentinel", b"")
    leaked = [(await at_ps.next_msg(timeout=OP_TIMEOUT_S)).subject for _ in range(3)]
    assert leaked[1:] == ["_INBOX.ps.x.leak", f"_INBOX.ps.{WORKER_REPLY_TOKEN}.abc.def"]  # all there to be read
    assert leaked[0].startswith("_INBOX.ps.")  # the PS's JetStream answer
    for role, client in readers.items():  # each gets its sentinel, and nothing before it
        assert (await own[role].next_msg(timeout=OP_TIMEOUT_S)).subject == f"_INBOX.{role}.sentinel"
        assert [sub.delivered for sub in others[role]] == [0, 0, 0, 0], role
        assert own[role].delivered == 1 and len(client.errors) == 4, (role, client.errors)


def _collect(into: list[str]):
    async def cb(msg) -> None:
        into.append(msg.subject)
    return cb


# ---- 4. who writes state and plans -------------------------------------------------------------------
async def test_only_the_ps_writes_state_and_only_the_scheduler_writes_plans(server, connect) -> None:
    """security.md:49-51: only the PS writes state; only the scheduler writes plans (the PS one key of the
    plans bucket, its job's shapes). Every other role tries to write a state key, a checkpoint object, a plan
    key, and to purge or delete from either bucket."""
    roles = await clients(server, connect)
    ps, sched = Bus(roles["ps"].nc, "ps"), Bus(roles["scheduler"].nc, "scheduler")
    await ps.setup()
    state, plans = await ps.kv(STATE_BUCKET, history=5), await sched.kv(PLAN_BUCKET, history=5)
    await state.put("j.head", b"honest")  # allowed: the PS writes state ...
    await plans.put(PLAN_KEY, b"honest")  # ... the scheduler the plan ...
    await (await ps.kv(PLAN_BUCKET, history=5)).put(SHAPES_KEY, b"shapes")  # ... and the PS its job's shapes
    assert all(c.errors == [] for c in roles.values())

    state_writes = [f"$KV.{STATE_BUCKET}.j.head", f"$KV.{STATE_BUCKET}.j.forged", f"$O.{STATE_OBJECTS}.M.weights",
                    f"$O.{STATE_OBJECTS}.C.chunk", f"$JS.API.STREAM.PURGE.{STATE}", f"$JS.API.STREAM.MSG.DELETE.{STATE}"]
    plan_writes = [f"$KV.{PLAN_BUCKET}.{PLAN_KEY}", f"$KV.{PLAN_BUCKET}.{SHAPES_KEY}", f"$KV.{PLAN_BUCKET}.forged",
                   f"$JS.API.STREAM.PURGE.{PLANS}", f"$JS.API.STREAM.MSG.DELETE.{PLANS}"]
    events_purge = [f"$JS.API.STREAM.PURGE.{EVENTS_STREAM}"]  # (the hub's runner, as the PS, forgets jobs)
    tried = {
        "monitor": state_writes + plan_writes + events_purge, "submitter": state_writes + plan_writes + events_purge,
        "worker": state_writes + plan_writes + events_purge, auth.PROBE_ECHO: state_writes + plan_writes + events_purge,
        "scheduler": state_writes + events_purge,  # the scheduler writes plans and events, not state; purges none
        "ps": [f"$KV.{PLAN_BUCKET}.{PLAN_KEY}", f"$KV.{PLAN_BUCKET}.forged", f"$JS.API.STREAM.PURGE.{PLANS}",
               f"$JS.API.STREAM.MSG.DELETE.{PLANS}"],  # the PS writes state and shapes, not the plan
    }
    for role, subjects in tried.items():
        await refuses(roles[role], "publish", subjects)
        assert len(roles[role].errors) == len(subjects), (role, roles[role].errors)

    assert (await state.get("j.head")).value == b"honest" and (await state.status()).values == 1
    assert (await plans.get(PLAN_KEY)).value == b"honest" and (await plans.status()).values == 2


# ---- 5. the leaf-node port takes site keys only ------------------------------------------------------
@dataclass
class Leaf:
    """A leaf nats-server dialling the hub's leaf-node port with one key."""

    proc: subprocess.Popen
    log: Path
    monitor: str
    url: str

    def outcome(self, since: int = 0, timeout_s: float = 10.0) -> str:
        """"refused" once the hub has turned its login away, "accepted" once the link is up (/leafz)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "Authorization Violation" in self.log.read_bytes()[since:].decode(errors="replace"):
                return "refused"
            try:
                if get_json(f"{self.monitor}/leafz").get("leafs"):
                    return "accepted"
            except OSError:  # its monitor not answering yet
                pass
            time.sleep(0.02)
        raise AssertionError(f"leaf node neither refused nor linked: {self.log.read_text()[-2000:]}")

    def unlinked(self, timeout_s: float = 10.0) -> None:
        """Until its link to the hub is down (/leafz lists none)."""
        deadline = time.monotonic() + timeout_s
        while get_json(f"{self.monitor}/leafz").get("leafs"):
            assert time.monotonic() < deadline, "the leaf node still reports its link"
            time.sleep(0.02)


@pytest.fixture
def leaves(tmp_path: Path) -> Iterator:
    started: list[Leaf] = []

    def make(leaf_port: int, name: str, seed: str, local_login: bool = True, worker_seed: str | None = None) -> Leaf:
        """A leaf node named `name` that logs in to the hub with `seed` (its workers log in with `worker_seed`, the
        site's worker credential, a new one by default; `local_login=False`: anyone may connect to it, a hostile
        site)."""
        port, monitor = free_port(), free_port()
        worker = auth.credential_from_seed("worker", "worker", worker_seed or auth.new_credential("worker").seed)
        opts = serverconf.LeafOptions(name=name, listen=f"127.0.0.1:{port}", http=f"127.0.0.1:{monitor}",
                                      hubs=(f"nats-leaf://127.0.0.1:{leaf_port}",))
        text = serverconf.leaf_config(auth.credential_from_seed(f"site-{name}", auth.SITE, seed), worker, opts)
        if not local_login:
            head, _, rest = text.partition("authorization {")
            text = head + rest.split("\n}\n", 1)[1]
        conf, log = tmp_path / f"leaf-{name}.conf", tmp_path / f"leaf-{name}.log"
        conf.write_text(text)
        leaf = Leaf(start_server(tmp_path, log, conf), log, f"http://127.0.0.1:{monitor}", f"nats://127.0.0.1:{port}")
        started.append(leaf)
        return leaf

    yield make
    for leaf in reversed(started):
        stop_server(leaf.proc)


@pytest.fixture
def site_hub(tmp_path: Path) -> Iterator[AuthServer]:
    """`cleave auth init --sites s1` with its leaf-node listener."""
    yield from launch(tmp_path, sites="s1", leaf_listen=f"127.0.0.1:{free_port()}")


def test_only_a_site_key_logs_in_on_the_leaf_port(site_hub: AuthServer, leaves) -> None:
    """security.md:96-98: the hub accepts a site's key for leaf-node connections only, and every other role's
    key for client connections only: each role's key dialling the leaf-node port is turned away, the site's
    is linked."""
    keys = {role: site_hub.seed(role) for role in CLIENT_ROLES}
    keys[auth.PROBE_ECHO] = site_hub.seed("scheduler", auth.PROBE_ECHO_ENV)
    tried = {role: leaves(site_hub.leaf_port, role, seed) for role, seed in keys.items()}
    site = leaves(site_hub.leaf_port, "s1", credentials.credential(site_hub.out / "sites" / "s1", "site",
                                                                     auth.SITE).seed)
    assert site.outcome() == "accepted"
    assert {role: leaf.outcome() for role, leaf in tried.items()} == dict.fromkeys(tried, "refused")


@pytest.fixture
def pinned_leaf_hub(tmp_path: Path) -> Iterator[AuthServer]:
    """`cleave auth init --worker-ids w1 --leaf-listen ...`."""
    yield from launch(tmp_path, worker_ids="w1", leaf_listen=f"127.0.0.1:{free_port()}")


def test_a_pinned_worker_key_is_no_leaf_login(pinned_leaf_hub: AuthServer, leaves) -> None:
    """security.md:96-98 with `--worker-ids`: a pinned worker's key is for client connections only too."""
    assert leaves(pinned_leaf_hub.leaf_port, "w1", pinned_leaf_hub.seed("worker-w1")).outcome() == "refused"


def test_the_admin_key_is_no_leaf_login(site_hub: AuthServer, leaves) -> None:
    """security.md:97-98 (every key but a site's for client connections only): the operators' key, which may
    publish and subscribe anything, dialling the leaf-node port is turned away (a leaf link with its rights
    would carry them to a whole site)."""
    assert leaves(site_hub.leaf_port, "admin", site_hub.admin_seed()).outcome() == "refused"


async def test_a_site_cannot_delete_or_update_a_stream_across_its_link(site_hub: AuthServer, connect, admin,
                                                                       leaves) -> None:
    """security.md:52-54 for the site, which cannot log in as a client: a hostile site's leaf node (no local
    login) sends the stream deletion and update requests; none reaches the hub, and the streams stay.

    (nats-server 2.15.1 itself keeps `$JS.API.>` from crossing a leaf link of a leaf node without JetStream,
    measured with no permissions at all: this holds even where the site's permissions would allow it.)"""
    await setup_streams(site_hub, connect)
    site_seed = credentials.credential(site_hub.out / "sites" / "s1", "site", auth.SITE).seed
    hostile_leaf = leaves(site_hub.leaf_port, "s1-hostile", site_seed, local_login=False)
    assert hostile_leaf.outcome() == "accepted"
    root = await admin(site_hub)
    hostile = await nats.connect(hostile_leaf.url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S)
    try:
        seen: list[str] = []
        await root.subscribe(">", cb=_collect(seen))
        await root.flush(timeout=OP_TIMEOUT_S)
        await _cross(hostile, seen, "cleave.hb.sentinel-1")  # the link carries what a site may send ...
        forbidden = [f"$JS.API.STREAM.{op}.{name}" for op in ("DELETE", "UPDATE")
                     for name in (EVENTS_STREAM, STATE, PLANS, JOBS_STREAM)]
        for subject in forbidden:
            await hostile.publish(subject, b"{}", reply="_INBOX.worker.h.1")
        await _cross(hostile, seen, "cleave.hb.sentinel-2")  # ... and, after the forbidden ones, the sentinel
        assert not set(seen) & set(forbidden), seen
        names = {s.config.name for s in await root.jetstream().streams_info()}
        assert {EVENTS_STREAM, STATE, PLANS, JOBS_STREAM} <= names
    finally:
        await hostile.close()


async def _cross(nc: nats.NATS, seen: list[str], sentinel: str) -> None:
    """Publish `sentinel` at the leaf until the hub's subscriber has it (interest crosses the link a moment
    after the subscription)."""
    deadline = time.monotonic() + OP_TIMEOUT_S
    while sentinel not in seen:
        assert time.monotonic() < deadline, f"{sentinel} never crossed the link"
        await nc.publish(sentinel, b"")
        await nc.flush(timeout=OP_TIMEOUT_S)
        for _ in range(20):
            if sentinel in seen:
                return
            await asyncio.sleep(0.01)


# ---- 6. TLS: the certificate's name ------------------------------------------------------------------
@pytest.fixture
def other_name_server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path, tls=True, hosts=["some.other.name"])


async def test_tls_refuses_a_certificate_that_does_not_name_the_server(other_name_server: AuthServer,
                                                                       connect) -> None:
    """security.md:292-295, deploy.md:328: a client verifies the hub's certificate against the CA, name
    included: `auth init --tls --host some.other.name` certifies that name (and localhost, 127.0.0.1, nats,
    always); a client that dials the hub as hub.example.org is refused, one dialling it as some.other.name
    connects."""
    srv = other_name_server
    cert = x509.load_pem_x509_certificate((srv.out / auth_cmd.TLS_DIR / auth_cmd.CERT_NAME).read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = {str(n.value) for n in sans}
    assert names == {"localhost", "127.0.0.1", "nats", "some.other.name"}  # not hub.example.org
    options = auth.connect_options(srv.settings("worker"), "worker")  # the generated CA
    error = await refused(srv.url, tls_hostname="hub.example.org", nkeys_seed_str=options["nkeys_seed_str"],
                          tls=options["tls"])
    assert "CERTIFICATE_VERIFY_FAILED" in error and "hub.example.org" in error, error
    worker = await connect(srv.settings("worker"), "worker", tls_hostname="some.other.name")
    await worker.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w1"), heartbeat("w1"))
    await worker.nc.flush(timeout=OP_TIMEOUT_S)
    assert worker.nc.is_connected and worker.errors == []


# ---- 7. revocation -----------------------------------------------------------------------------------
async def test_a_pinned_worker_is_revoked_by_removing_its_user_and_reloading(pinned_server: AuthServer,
                                                                             connect) -> None:
    """security.md:381-383: with --worker-ids, remove that user from nats.conf and reload the server
    (`nats-server --signal reload`): its key is refused (and its open connection closed), another pinned
    worker goes on."""
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    w1 = await connect(pinned_server.settings("worker", "worker-w1"), "worker", closed_cb=on_closed)
    w2 = await connect(pinned_server.settings("worker", "worker-w2"), "worker")
    conf = pinned_server.out / auth_cmd.CONFIG_NAME
    text, public = conf.read_text(), credentials.credential(pinned_server.out, "worker-w1", "worker").public
    edited, n = re.subn(r"    # worker-w1\n    \{\n.*?\n    \},\n", "", text, flags=re.S)
    assert n == 1 and public not in edited and credentials.credential(
        pinned_server.out, "worker-w2", "worker").public in edited
    conf.write_text(edited)
    offset = pinned_server.log.stat().st_size
    signal = await asyncio.create_subprocess_exec(nats_server_binary(), "--signal", f"reload={pinned_server.proc.pid}")
    assert await asyncio.wait_for(signal.wait(), OP_TIMEOUT_S) == 0
    _wait_log(pinned_server.log, offset, "Reloaded server configuration")

    settings = pinned_server.settings("worker", "worker-w1")
    assert "Authorization Violation" in await refused(pinned_server.url, **auth.connect_options(settings, "worker"))
    await asyncio.wait_for(closed.wait(), OP_TIMEOUT_S)  # the thief's open connection is closed too
    await w2.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w2"), heartbeat("w2"))
    await w2.nc.flush(timeout=OP_TIMEOUT_S)
    assert w2.nc.is_connected and w2.errors == []
    again = await connect(pinned_server.settings("worker", "worker-w2"), "worker")
    await again.nc.flush(timeout=OP_TIMEOUT_S)
    assert again.nc.is_connected and w1.nc.is_closed


def _wait_log(log: Path, offset: int, text: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while text not in log.read_bytes()[offset:].decode(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
        time.sleep(0.02)


@dataclass
class Hub:
    """nats-server as `cleave up --listen 127.0.0.1:PORT --auth DIR` configures it: its users derived from DIR at
    each start (`HubConfig.of`)."""

    auth_dir: Path
    tmp: Path
    port: int
    leaf_port: int
    monitor_port: int
    proc: subprocess.Popen | None = None

    def start(self) -> HubConfig:
        hub = HubConfig.of(f"127.0.0.1:{self.port}", self.auth_dir, leaf_port=self.leaf_port)
        conf = self.tmp / "hub.conf"
        conf.write_text(hub.server_config(str(self.tmp / "js"), self.monitor_port, 1024 * 1024))
        self.proc = start_server(self.auth_dir, self.tmp / "hub.log", conf)
        return hub

    def leafs(self) -> list[str]:
        return [x.get("name", "") for x in get_json(f"http://127.0.0.1:{self.monitor_port}/leafz").get("leafs", [])]


@pytest.fixture
def hub_of(tmp_path: Path) -> Iterator:
    hubs: list[Hub] = []

    def make(**init) -> Hub:
        out = tmp_path / "auth"
        auth_cmd.init(authserver.init_args(out, free_port(), **init))
        hub = Hub(out, tmp_path, free_port(), free_port(), free_port())
        hubs.append(hub)
        return hub

    yield make
    for hub in hubs:
        stop_server(hub.proc)


async def test_the_hub_drops_a_workers_user_whose_env_file_is_gone(hub_of, connect) -> None:
    """security.md:383 and hub.py: `cleave up --auth DIR` derives the server's users from DIR/*.env each time it
    starts; with worker-w1.env deleted and the hub restarted, w1's key is refused and w2's still logs in."""
    hub = hub_of(worker_ids="w1,w2")
    hub.start()
    view = AuthServer(hub.auth_dir, hub.port, tls=False)
    w1_settings = view.settings("worker", "worker-w1")
    assert (await connect(w1_settings, "worker")).nc.is_connected  # it logs in before
    (hub.auth_dir / "worker-w1.env").unlink()
    stop_server(hub.proc)
    assert [c.name for c in hub.start().creds if c.role == "worker"] == ["worker-w2"]
    assert "Authorization Violation" in await refused(view.url, **auth.connect_options(w1_settings, "worker"))
    w2 = await connect(view.settings("worker", "worker-w2"), "worker")
    await w2.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w2"), heartbeat("w2"))
    await w2.nc.flush(timeout=OP_TIMEOUT_S)
    assert w2.errors == []


async def test_a_site_is_revoked_by_deleting_its_folder_and_restarting_the_hub(hub_of, leaves, connect) -> None:
    """security.md ("A site: ... delete DIR/sites/<name>/ and restart the hub"): that site's leaf node is
    refused at its next login, another site links again, and nothing of the deleted folder logs in on the hub:
    its workers' key (its worker.env, which its leaf node takes) is refused at the hub's client port, while the
    site is valid and after. (The folder held the hub's shared worker seed: the revoked site logged in there
    as any worker.)"""
    hub = hub_of(sites="s1,s2")
    hub.start()
    folders = {s: hub.auth_dir / "sites" / s for s in ("s1", "s2")}
    seeds = {s: credentials.credential(f, "site", auth.SITE).seed for s, f in folders.items()}
    workers = {s: credentials.credential(f, "worker", "worker").seed for s, f in folders.items()}
    s1, s2 = (leaves(hub.leaf_port, s, seeds[s], worker_seed=workers[s]) for s in ("s1", "s2"))
    assert s1.outcome() == "accepted" and s2.outcome() == "accepted"
    view = AuthServer(hub.auth_dir, hub.port, tls=False)
    at_hub, at_leaf = (SimpleNamespace(nats_url=url, nats_nkey_seed=workers["s1"]) for url in (view.url, s1.url))
    worker = await connect(at_leaf, "worker")  # its workers log in to its leaf node with it ...
    await worker.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="s1-w1"), heartbeat("s1-w1"))
    await worker.nc.flush(timeout=OP_TIMEOUT_S)
    assert worker.errors == []
    assert "Authorization Violation" in await refused(view.url, **auth.connect_options(at_hub, "worker"))  # ... not here
    stop_server(hub.proc)
    for leaf in (s1, s2):  # both have seen their link go (so a link they report later is a new one)
        leaf.unlinked()
    kept = shutil.copytree(folders["s1"], hub.tmp / "s1-kept")  # what the revoked site still holds
    shutil.rmtree(folders["s1"])
    offset = s1.log.stat().st_size
    hub.start()
    assert s1.outcome(since=offset) == "refused"
    deadline = time.monotonic() + 10
    while "leaf-s2" not in hub.leafs():  # s2 dials again (its leaf node retries every second)
        assert time.monotonic() < deadline, hub.leafs()
        await asyncio.sleep(0.02)
    assert "leaf-s1" not in hub.leafs()
    for name, role in (("worker", "worker"), ("site", auth.SITE)):  # no key it kept is a client login either
        kept_settings = SimpleNamespace(nats_url=view.url, nats_nkey_seed=credentials.credential(kept, name, role).seed)
        assert "Authorization Violation" in await refused(view.url, **auth.connect_options(kept_settings, role))


# ---- 8. passwords ------------------------------------------------------------------------------------
async def test_the_generated_config_has_no_password_login(server: AuthServer) -> None:
    """security.md:25 ("a wrong password is refused at connect"): `cleave auth init` issues nkeys only, so no
    user logs in with a password: every user of nats.conf is an nkey, and a user/password login is refused
    for every role name, whatever the password (even the role's own seed)."""
    text = (server.out / auth_cmd.CONFIG_NAME).read_text()
    assert "password" not in text and not re.search(r"^\s*user\s*:", text, flags=re.M)
    users = re.findall(r"nkey: \"(U[A-Z0-9]+)\"", text)
    issued = [p.stem for p in server.out.glob("*.env")]
    assert len(users) == len(issued) + 2  # each .env (the scheduler's with its probe echo) and admin.nk
    for role in (*auth.ROLES, auth.ADMIN):
        guess = server.seed(role) if (server.out / f"{role}.env").exists() else "guess"
        assert "Authorization Violation" in await refused(server.url, user=role, password=guess)


async def test_a_password_login_on_a_server_you_run_refuses_a_wrong_password(tmp_path: Path) -> None:
    """deploy.md:340: CLEAVE_<ROLE>_NATS_USER / _NATS_PASSWORD, for a NATS server you run with passwords (not one
    `cleave auth init` configures): the right password logs in, a wrong one is refused at connect."""
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\nauthorization {{\n  users: [\n'
                    f'    {{ user: "ps", password: "right-horse-battery" }}\n  ]\n}}\n')
    proc = start_server(tmp_path, tmp_path / "nats.log", conf)
    try:
        url = f"nats://127.0.0.1:{port}"
        wrong = auth.connect_options(PsSettings(nats_url=url, nats_user="ps", nats_password="guess"), "ps")
        assert "Authorization Violation" in await refused(url, **wrong)
        right = auth.connect_options(PsSettings(nats_url=url, nats_user="ps", nats_password="right-horse-battery"), "ps")
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S, **right)
        await nc.flush(timeout=OP_TIMEOUT_S)
        assert nc.is_connected
        await nc.close()
    finally:
        stop_server(proc)


def test_a_credential_without_the_submitters_rights_is_told_so_not_that_there_are_no_jobs(server, tmp_path) -> None:
    """A worker's credential given as the submitter's: the server drops its requests without a reply, and
    `cleave status` said 'no jobs on this hub' (exit 0), `the hub knows no job`, `holds no persisted PS state`."""
    from cleave.api import hub
    from cleave.api.jobs import export

    assert hub.status(server.url, server.out) == []  # the submitter's own: a hub with no job yet
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(server.out / "worker.env", wrong / "submitter.env")
    with pytest.raises(CleaveError, match=r"could not be read \(TimeoutError\)\. .*is --auth the submitter's folder"):
        hub.status(server.url, wrong)
    with pytest.raises(CleaveError, match=r"PS state at .* could not be read .*is --auth the submitter's folder"):
        export(tmp_path / "out", nats=server.url, auth=wrong, job_id="j")
    with pytest.raises(CleaveError, match="holds no persisted PS state"):  # the submitter's own: there is none
        export(tmp_path / "out", nats=server.url, auth=server.out, job_id="j")


def test_a_hub_on_an_address_its_certificate_does_not_name_says_so_in_one_line(tmp_path) -> None:
    """The error was right but came after a 20-line traceback from nats-py's own error callback."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "cleave_cli", "auth", "init", "--out", str(tmp_path / "auth"), "--tls"],
                   check=True, capture_output=True, timeout=60)
    up = subprocess.run([sys.executable, "-m", "cleave_cli", "up", "--listen", f"127.0.0.2:{free_port()}", "--auth",
                         str(tmp_path / "auth"), "--workers", "0", "--run-dir", str(tmp_path / "run")],
                        capture_output=True, text=True, timeout=120)
    assert up.returncode == 2, up.stderr[-2000:]
    assert "its certificate does not name 127.0.0.2" in up.stderr and "--tls --host 127.0.0.2`" in up.stderr
    assert "Traceback" not in up.stderr and "encountered error" not in up.stderr, up.stderr[-3000:]
