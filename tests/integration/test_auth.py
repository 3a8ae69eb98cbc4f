"""`cleave auth init` against a real nats-server: who may connect, publish and subscribe, and TLS.

Each test writes a fresh config with the real `auth init` code, starts nats-server with it on a free port
and waits for its "Server is ready" line. A refusal is observed the way a service would see it: the
connect raises, or the server reports a permissions violation through `error_cb`.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest
from nats.js.api import DeliverPolicy

from cleave import auth, codec
from cleave.api.natsconf import free_port, nats_server_binary
from cleave.bus import Bus, receive
from cleave.schemas import (
    EVENTS_STREAM,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    STATE_BUCKET,
    STATE_OBJECTS,
    SUBJECT_EVENTS_ALL,
    SUBJECT_HEARTBEAT,
    SUBJECT_MODELS_GET,
    SUBJECT_PROBE,
    SUBJECT_PROBE_ALL,
    SUBJECT_PROBE_FROM,
    SUBJECT_RESULTS,
    SUBJECT_TILES,
    SUBJECT_UPDATES,
    DeviceProfile,
    Event,
    Heartbeat,
    Plan,
    TileResult,
)
from cleave_cli import auth_cmd
from cleave_monitor.settings import MonitorSettings
from cleave_ps.settings import PsSettings
from cleave_scheduler.settings import SchedulerSettings
from cleave_worker.settings import WorkerSettings

READY_TIMEOUT_S = 20.0
OP_TIMEOUT_S = 5.0
pytestmark = pytest.mark.timeout(60)
SETTINGS = {"ps": PsSettings, "scheduler": SchedulerSettings, "monitor": MonitorSettings, "worker": WorkerSettings}


@dataclass
class AuthServer:
    """A nats-server running the config `cleave auth init` wrote into `out`."""

    out: Path
    port: int
    tls: bool
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def seed(self, name: str, var: str = "") -> str:
        """The seed in `<name>.env` (its first, or the one of variable `var`)."""
        line = next(x for x in (self.out / f"{name}.env").read_text().splitlines()
                    if x.startswith(var or "CLEAVE_"))
        return line.split("=", 1)[1]

    def probe_echo(self) -> SimpleNamespace:
        """Settings of the scheduler's probe connection (`scheduler.env` holds its second seed)."""
        ca = self.out / auth_cmd.TLS_DIR / auth_cmd.CA_NAME if self.tls else None
        return SimpleNamespace(nats_url=self.url, nats_tls_ca=ca,
                               nats_nkey_seed=self.seed("scheduler", "CLEAVE_SCHEDULER_PROBE_NKEY_SEED"))

    def settings(self, role: str, name: str | None = None):
        ca = self.out / auth_cmd.TLS_DIR / auth_cmd.CA_NAME if self.tls else None
        extra = {"worker_id": name.removeprefix("worker-")} if name and name.startswith("worker-") else {}
        return SETTINGS.get(role, SimpleNamespace)(nats_url=self.url, nats_nkey_seed=self.seed(name or role),
                                                   nats_tls_ca=ca, **extra)


def start_server(out: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(out / auth_cmd.CONFIG_NAME)],
                                stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "Server is ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"nats-server did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.02)
    return proc


def init_args(out: Path, port: int, **over) -> argparse.Namespace:
    base = dict(out=out, tls=False, hosts=None, tls_cert=None, tls_key=None, tls_ca=None, worker_ids="",
                listen=f"127.0.0.1:{port}", http=f"127.0.0.1:{free_port()}", store_dir=str(out.parent / "js"),
                server_dir=None, max_payload=1024 * 1024, force=False)
    return argparse.Namespace(**{**base, **over})


def launch(tmp_path: Path, **over) -> Iterator[AuthServer]:
    port = free_port()
    out = tmp_path / "auth"
    auth_cmd.init(init_args(out, port, **over))
    server = AuthServer(out, port, tls=bool(over.get("tls") or over.get("tls_cert")))
    server.proc = start_server(out, tmp_path / "nats.log")
    try:
        yield server
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path, tls=True, hosts=["127.0.0.1", "localhost"])


@pytest.fixture
def pinned_server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path, worker_ids="w1,w2")


@dataclass
class Client:
    """A connection as a role, recording the errors the server reports (permission violations)."""

    nc: nats.NATS
    errors: list[str] = field(default_factory=list)
    got_error: asyncio.Event = field(default_factory=asyncio.Event)

    async def violation(self, subject: str) -> str:
        """Wait for the server to report a permissions violation naming `subject` (nats-py lower-cases it)."""
        subject = subject.lower()
        async with asyncio.timeout(OP_TIMEOUT_S):
            while not any(subject in e.lower() for e in self.errors):
                self.got_error.clear()
                await self.got_error.wait()
        return next(e for e in self.errors if subject in e.lower())


@pytest.fixture
async def connect() -> AsyncIterator:
    clients: list[Client] = []

    async def make(settings, role: str) -> Client:
        client = Client(nc=None)  # type: ignore[arg-type]

        async def on_error(e: Exception) -> None:
            client.errors.append(str(e))
            client.got_error.set()

        client.nc = await receive.connect(settings.nats_url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S,
                                       error_cb=on_error, **auth.connect_options(settings, role))
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.nc.close()


async def refused(url: str, **options) -> str:
    """The error a connection attempt ends with (the test fails if it connects)."""
    async def quiet(e: Exception) -> None:
        pass

    nc = nats.NATS()
    try:
        await nc.connect(url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S, error_cb=quiet, **options)
    except Exception as e:
        discard(nc)
        return str(e)
    await nc.close()
    pytest.fail(f"connected to {url} with {sorted(options)}")


def discard(nc: nats.NATS) -> None:
    """Close a refused client's sockets: nats-py leaves them open, and its close() hangs after a TLS failure."""
    transport = nc._transport
    if transport is not None:
        for writer in {transport._io_writer, transport._bare_io_writer} - {None}:
            writer.close()


def tile_result(worker_id: str) -> TileResult:
    return TileResult(job="j", epoch=1, step=0, op=1, tile=0, attempt=0, worker_id=worker_id, error="test")


def heartbeat(worker_id: str) -> bytes:
    profile = DeviceProfile(flops=1e9, memory_bytes=1 << 20, downlink_bytes_per_s=1e6, uplink_bytes_per_s=1e6,
                            latency_s=0.0)
    return codec.encode(Heartbeat(worker_id=worker_id, profile=profile, sent_at=1.0, started_at=0.0))


# ---- who may connect ---------------------------------------------------------------------------------
async def test_no_credentials_is_refused(server: AuthServer) -> None:
    assert "Authorization Violation" in await refused(server.url)


async def test_unknown_nkey_is_refused(server: AuthServer) -> None:
    stranger = auth.new_credential("worker")  # a valid nkey the server has never heard of
    assert "Authorization Violation" in await refused(server.url, nkeys_seed_str=stranger.seed)


async def test_wrong_password_is_refused(server: AuthServer) -> None:
    assert "Authorization Violation" in await refused(server.url, user="ps", password="guess")


async def test_every_issued_credential_connects(server: AuthServer, connect) -> None:
    for role in (*SETTINGS, auth.SUBMITTER):  # (a site's key makes leaf links only: test_site_links.py)
        client = await connect(server.settings(role), role)
        await client.nc.flush(timeout=OP_TIMEOUT_S)
        assert client.nc.is_connected


# ---- what a worker may do ----------------------------------------------------------------------------
async def test_worker_cannot_publish_tiles_plans_or_state(server: AuthServer, connect) -> None:
    victim = await connect(server.settings("worker"), "worker")  # another worker, waiting for its tiles
    inbox = await victim.nc.subscribe(SUBJECT_TILES.format(worker_id="x"))
    await victim.nc.flush(timeout=OP_TIMEOUT_S)
    hostile = await connect(server.settings("worker"), "worker")
    for subject in (SUBJECT_TILES.format(worker_id="x"), f"$KV.{PLAN_BUCKET}.{PLAN_KEY}",
                    f"$KV.{STATE_BUCKET}.head", "cleave.events.worker_joined"):
        await hostile.nc.publish(subject, b"forged")
        assert "permissions violation for publish" in await hostile.violation(subject)
    await hostile.nc.flush(timeout=OP_TIMEOUT_S)  # the server has handled every forged publish ...
    await victim.nc.flush(timeout=OP_TIMEOUT_S)  # ... and anything it routed to the victim has arrived
    assert inbox.pending_msgs == 0
    assert hostile.nc.is_connected  # refused messages, not a dropped connection


async def test_worker_cannot_subscribe_to_results_or_heartbeats(server: AuthServer, connect) -> None:
    hostile = await connect(server.settings("worker"), "worker")
    for subject in (SUBJECT_RESULTS.format(job="j", epoch=1, worker_id="*"), "cleave.hb.*", SUBJECT_PROBE, SUBJECT_PROBE_ALL,
                    "_INBOX.ps.>", "$KV.>"):
        await hostile.nc.subscribe(subject)
        assert "permissions violation for subscription" in await hostile.violation(subject)


async def test_worker_publishes_results_and_heartbeats(server: AuthServer, connect) -> None:
    ps = await connect(server.settings("ps"), "ps")
    sched = await connect(server.settings("scheduler"), "scheduler")
    results = await ps.nc.subscribe(auth._wild(SUBJECT_RESULTS))
    beats = await sched.nc.subscribe(auth._wild(SUBJECT_HEARTBEAT))
    await ps.nc.flush(timeout=OP_TIMEOUT_S)
    await sched.nc.flush(timeout=OP_TIMEOUT_S)
    worker = await connect(server.settings("worker"), "worker")
    await worker.nc.publish(SUBJECT_RESULTS.format(job="j", epoch=7, worker_id="w1"), b"block")
    await worker.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w1"), heartbeat("w1"))
    assert (await results.next_msg(timeout=OP_TIMEOUT_S)).data == b"block"
    assert codec.decode((await beats.next_msg(timeout=OP_TIMEOUT_S)).data, Heartbeat).worker_id == "w1"
    assert worker.errors == []


async def test_worker_probes_and_the_scheduler_answers(server: AuthServer, connect) -> None:
    """Probes are answered by the scheduler's second credential, which may publish to workers' inboxes and
    nowhere else; the scheduler's own credential neither reads probes nor writes to a worker's inbox."""
    echo_c = await connect(server.probe_echo(), "scheduler")

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    await echo_c.nc.subscribe(SUBJECT_PROBE_ALL, cb=echo)
    await echo_c.nc.flush(timeout=OP_TIMEOUT_S)
    settings = server.settings("worker")
    worker = await connect(settings, "worker")
    probe = SUBJECT_PROBE_FROM.format(worker_id=settings.worker_id)
    assert (await worker.nc.request(probe, b"ping" * 1000, timeout=OP_TIMEOUT_S)).data == b"ping" * 1000
    for subject in (f"$KV.{PLAN_BUCKET}.{PLAN_KEY}", f"$JS.API.STREAM.PURGE.KV_{REGISTRY_BUCKET}", "cleave.events.x"):
        await echo_c.nc.publish(subject, b"forged")  # the echo may write nothing but answers
        assert "publish" in await echo_c.violation(subject)
    sched = await connect(server.settings("scheduler"), "scheduler")
    await sched.nc.publish("_INBOX.worker.someone.x", b"unsolicited")
    assert "publish" in await sched.violation("_INBOX.worker.someone.x")
    await sched.nc.subscribe(SUBJECT_PROBE_ALL)
    assert "subscription" in await sched.violation(SUBJECT_PROBE_ALL)
    assert worker.errors == []


async def test_pinned_worker_credential_covers_only_its_own_id(pinned_server: AuthServer, connect) -> None:
    assert not (pinned_server.out / "worker.env").exists()  # no shared credential when ids are given
    sched = await connect(pinned_server.probe_echo(), "scheduler")

    async def pong(msg) -> None:
        await msg.respond(b"pong")

    await sched.nc.subscribe(SUBJECT_PROBE_ALL, cb=pong)
    await sched.nc.flush(timeout=OP_TIMEOUT_S)
    w1 = await connect(pinned_server.settings("worker", "worker-w1"), "worker")
    own = SUBJECT_PROBE_FROM.format(worker_id="w1")
    assert (await w1.nc.request(own, b"ping", timeout=OP_TIMEOUT_S)).data == b"pong"  # its own inbox
    await w1.nc.publish(SUBJECT_PROBE_FROM.format(worker_id="w2"), b"ping")  # probing as w2
    assert "publish" in await w1.violation(SUBJECT_PROBE_FROM.format(worker_id="w2"))
    w1.errors.clear()
    await w1.nc.subscribe(SUBJECT_TILES.format(worker_id="w1"))
    await w1.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w1"), heartbeat("w1"))
    await w1.nc.flush(timeout=OP_TIMEOUT_S)
    assert w1.errors == []
    await w1.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w2"), heartbeat("w2"))  # impersonating w2
    assert "publish" in await w1.violation(SUBJECT_HEARTBEAT.format(worker_id="w2"))
    await w1.nc.subscribe(SUBJECT_TILES.format(worker_id="w2"))  # reading w2's tiles
    assert "subscription" in await w1.violation(SUBJECT_TILES.format(worker_id="w2"))
    await w1.nc.subscribe("_INBOX.worker.w2.>")  # or w2's probe replies
    assert "subscription" in await w1.violation("_INBOX.worker.w2.>")
    await w1.nc.publish(SUBJECT_MODELS_GET.format(worker_id="w2"), b"{}", reply="_INBOX.worker.w2.x.1")  # asking the
    assert "publish" in await w1.violation(SUBJECT_MODELS_GET.format(worker_id="w2"))  # PS for models as w2


async def test_pinned_worker_publishes_results_only_as_itself(pinned_server: AuthServer, connect) -> None:
    """Results and round updates travel on per-worker subjects: the server refuses w1 publishing on w2's,
    and the PS's bus refuses a result on w1's subject that claims to come from w2."""
    ps_c = await connect(pinned_server.settings("ps"), "ps")
    ps, got = Bus(ps_c.nc, "ps"), asyncio.Queue()

    async def on_result(msg: TileResult, nbytes: int) -> None:
        await got.put(msg)

    await ps.subscribe(SUBJECT_RESULTS.format(job="j", epoch=1, worker_id="*"), TileResult, on_result,
                       sender="worker_id")
    updates = await ps_c.nc.subscribe(SUBJECT_UPDATES.format(job="j", epoch=1, worker_id="*"))
    await ps_c.nc.flush(timeout=OP_TIMEOUT_S)
    w1 = await connect(pinned_server.settings("worker", "worker-w1"), "worker")
    for subject in (SUBJECT_RESULTS.format(job="j", epoch=1, worker_id="w2"),
                    SUBJECT_UPDATES.format(job="j", epoch=1, worker_id="w2")):
        await w1.nc.publish(subject, codec.encode(tile_result("w2")))  # impersonating w2
        assert "permissions violation for publish" in await w1.violation(subject)
    own = SUBJECT_RESULTS.format(job="j", epoch=1, worker_id="w1")
    await w1.nc.publish(own, codec.encode(tile_result("w2")))  # its own subject, w2's name inside
    await w1.nc.publish(own, codec.encode(tile_result("w1")))
    await w1.nc.publish(SUBJECT_UPDATES.format(job="j", epoch=1, worker_id="w1"), b"update")
    assert (await asyncio.wait_for(got.get(), OP_TIMEOUT_S)).worker_id == "w1"
    assert (await updates.next_msg(timeout=OP_TIMEOUT_S)).data == b"update"
    assert ps.rejected == {"wrong_sender": 1} and got.empty()
    assert len(w1.errors) == 2  # the two refused publishes; its own subjects raised none


# ---- what the services may do through the real Bus ---------------------------------------------------
async def test_services_run_their_jetstream_work_and_nothing_more(server: AuthServer, connect) -> None:
    ps_c = await connect(server.settings("ps"), "ps")
    sched_c = await connect(server.settings("scheduler"), "scheduler")
    mon_c = await connect(server.settings("monitor"), "monitor")
    ps, sched = Bus(ps_c.nc, "ps"), Bus(sched_c.nc, "scheduler")
    async with asyncio.timeout(12 * OP_TIMEOUT_S):  # a guard against a hang: ~20 JetStream calls, on a loaded machine
        await sched.setup()  # the first one creates every stream and bucket ...
        await ps.setup()  # ... the second finds them
        plans = await ps.kv(PLAN_BUCKET)
        watcher = await plans.watch(PLAN_KEY)  # what the PS runs to follow the plan
        plan = Plan(version=1, created_at=1.0, workers=(), tile_rows=8, tile_cols=8, reason="start")
        await sched.kv_put(await sched.kv(PLAN_BUCKET), PLAN_KEY, plan)
        await sched.kv_put(await sched.kv(REGISTRY_BUCKET), "w1", plan)  # any message will do
        entry = await watcher.updates(timeout=OP_TIMEOUT_S)
        while entry is None or entry.value is None:  # the watcher's initial "no more history" marker
            entry = await watcher.updates(timeout=OP_TIMEOUT_S)
        assert codec.decode(entry.value, Plan).version == 1
        await watcher.stop()
        state = await ps.kv(STATE_BUCKET)
        await ps.kv_put(state, "head", plan)
        assert (await ps.kv_get(state, "head", Plan))[0].version == 1
        objects = await ps.js.create_object_store(STATE_OBJECTS)
        await objects.put("weights", b"\x01" * 300_000)
        assert (await objects.get("weights")).data == b"\x01" * 300_000
        await objects.delete("weights")
        await ps.emit(Event(kind="ps_resumed", at=1.0))
        await sched.emit(Event(kind="plan_changed", at=2.0))
        await ps_c.nc.flush(timeout=OP_TIMEOUT_S)
        await watch_as_the_monitor(mon_c)
    assert ps_c.errors == [] and sched_c.errors == [] and mon_c.errors == []
    # only the scheduler publishes plans (the PS describes its job's GEMMs); only the PS writes state
    await ps.kv_put(await ps.kv(PLAN_BUCKET), SHAPES_KEY, plan)  # (any message will do)
    assert ps_c.errors == []
    await ps_c.nc.publish(f"$KV.{PLAN_BUCKET}.{PLAN_KEY}", codec.encode(plan))
    assert "publish" in await ps_c.violation(f"$KV.{PLAN_BUCKET}.{PLAN_KEY}")
    await sched_c.nc.publish(f"$KV.{STATE_BUCKET}.head", codec.encode(plan))
    assert "publish" in await sched_c.violation(f"$KV.{STATE_BUCKET}.head")
    for subject in ("cleave.events.forged", f"$KV.{REGISTRY_BUCKET}.w9", SUBJECT_TILES.format(worker_id="w1")):
        await mon_c.nc.publish(subject, b"forged")  # the monitor only reads
        assert "publish" in await mon_c.violation(subject)


async def watch_as_the_monitor(client: Client) -> None:
    """What the monitor runs: Bus.setup(), replay the events stream, watch the registry and the plan."""
    mon = Bus(client.nc, "monitor")
    await mon.setup()
    seen: asyncio.Queue = asyncio.Queue()

    async def on_event(msg) -> None:
        await seen.put(msg.subject)

    sub = await mon.js.subscribe(SUBJECT_EVENTS_ALL, stream=EVENTS_STREAM, cb=on_event, ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
    assert {await seen.get(), await seen.get()} == {"cleave.events.ps_resumed", "cleave.events.plan_changed"}
    await sub.unsubscribe()
    for bucket, key in ((REGISTRY_BUCKET, ">"), (PLAN_BUCKET, PLAN_KEY)):
        watcher = await (await mon.kv(bucket)).watch(key)
        entry = await watcher.updates(timeout=OP_TIMEOUT_S)
        assert entry is not None and entry.value
        await watcher.stop()


async def test_the_admin_credential_manages_streams(server: AuthServer, connect) -> None:
    sched = await connect(server.settings("scheduler"), "scheduler")
    await Bus(sched.nc, "scheduler").setup()
    seed = (server.out / auth_cmd.ADMIN_NAME).read_text().strip()
    nc = await nats.connect(server.url, nkeys_seed_str=seed, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S)
    try:  # what `nats stream edit --replicas` does on a cluster: only an operator may
        info = await nc.jetstream().stream_info(f"KV_{PLAN_BUCKET}")
        await nc.jetstream().update_stream(info.config)
    finally:
        await nc.close()


async def test_a_stolen_worker_credential_cannot_touch_jetstream(server: AuthServer, connect) -> None:
    hostile = await connect(server.settings("worker"), "worker")
    for subject in (f"$JS.API.STREAM.DELETE.KV_{PLAN_BUCKET}", "$JS.API.STREAM.NAMES", "$JS.API.INFO"):
        await hostile.nc.publish(subject, b"")
        assert "publish" in await hostile.violation(subject)


# ---- TLS ---------------------------------------------------------------------------------------------
async def test_tls_with_the_generated_certificate(tls_server: AuthServer, connect) -> None:
    worker = await connect(tls_server.settings("worker"), "worker")
    await worker.nc.publish(SUBJECT_HEARTBEAT.format(worker_id="w1"), heartbeat("w1"))
    await worker.nc.flush(timeout=OP_TIMEOUT_S)
    assert worker.nc.is_connected and worker.errors == []
    assert worker.nc._transport and worker.nc._transport.stream.transport.get_extra_info("sslcontext")


async def test_tls_is_required_and_verified(tls_server: AuthServer) -> None:
    seed = tls_server.seed("worker")
    plain = f"nats://127.0.0.1:{tls_server.port}"
    # the system trust store does not know the generated CA: no silent downgrade to an unverified link
    assert "CERTIFICATE_VERIFY_FAILED" in await refused(plain, nkeys_seed_str=seed)
    settings = WorkerSettings(nats_url=tls_server.url, nats_tls_ca=tls_server.out / "tls" / "ca.pem")
    assert "Authorization Violation" in await refused(tls_server.url, **auth.connect_options(settings, "worker"))
