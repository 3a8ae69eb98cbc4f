"""`cleave auth init` against a real nats-server: who may connect, publish and subscribe, and TLS.

Each test writes a fresh config with the real `auth init` code, starts nats-server with it on a free port
and waits for its "Server is ready" line (`tests/integration/authserver.py`). A refusal is observed the way a
service would see it: the connect raises, or the server reports a permissions violation through `error_cb`.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js.api import DeliverPolicy

from cleave import auth, codec
from cleave.api import hub
from cleave.bus import Bus, history
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    STATE_BUCKET,
    STATE_OBJECTS,
    SUBJECT_EVENTS_ALL,
    SUBJECT_HEARTBEAT,
    SUBJECT_JOB_SUBMIT,
    SUBJECT_MODELS_GET,
    SUBJECT_PROBE,
    SUBJECT_PROBE_ALL,
    SUBJECT_PROBE_FROM,
    SUBJECT_RESULTS,
    SUBJECT_TILES,
    SUBJECT_UPDATES,
    Event,
    Heartbeat,
    JobRecord,
    Plan,
    StateHead,
    StepMetrics,
    TileResult,
)
from cleave.schemas.subjects import stream_purge
from cleave_cli import auth_cmd, forget
from cleave_worker.settings import WorkerSettings
from tests.integration import authserver
from tests.integration.authserver import OP_TIMEOUT_S, SETTINGS, AuthServer, Client, heartbeat, refused

server, tls_server, pinned_server = authserver.server, authserver.tls_server, authserver.pinned_server  # fixtures
connect = authserver.connect  # (a fixture)
init_args, launch, start_server = authserver.init_args, authserver.launch, authserver.start_server  # (test_bundles, test_hostile)

pytestmark = pytest.mark.timeout(60)


def tile_result(worker_id: str) -> TileResult:
    return TileResult(job="j", epoch=1, step=0, op=1, tile=0, attempt=0, worker_id=worker_id, error="test")


# ---- who may connect ---------------------------------------------------------------------------------
async def test_no_credentials_is_refused(server: AuthServer) -> None:
    assert "Authorization Violation" in await refused(server.url)


async def test_unknown_nkey_is_refused(server: AuthServer) -> None:
    stranger = auth.new_credential("worker")  # a valid nkey the server has never heard of
    assert "Authorization Violation" in await refused(server.url, nkeys_seed_str=stranger.seed)


async def test_every_issued_credential_connects(server: AuthServer, connect) -> None:
    for role in (*SETTINGS, auth.SUBMITTER):  # (a site's key makes leaf links only: test_site_links.py)
        client = await connect(server.settings(role), role)
        await client.nc.flush(timeout=OP_TIMEOUT_S)
        assert client.nc.is_connected


# ---- what a worker may do ----------------------------------------------------------------------------
async def test_worker_cannot_publish_tiles_plans_or_state_nor_submit_or_cancel_a_job(server: AuthServer,
                                                                                       connect) -> None:
    victim = await connect(server.settings("worker"), "worker")  # another worker, waiting for its tiles
    inbox = await victim.nc.subscribe(SUBJECT_TILES.format(worker_id="x"))
    await victim.nc.flush(timeout=OP_TIMEOUT_S)
    hostile = await connect(server.settings("worker"), "worker")
    for subject in (SUBJECT_TILES.format(worker_id="x"), f"$KV.{PLAN_BUCKET}.{PLAN_KEY}",
                    f"$KV.{STATE_BUCKET}.head", "cleave.events.worker_joined",
                    SUBJECT_JOB_SUBMIT.format(job="j")):  # (a submission or a cancel: `cleave cancel`)
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


async def test_a_star_a_worker_may_subscribe_is_one_token_even_under_a_literal_gt(server: AuthServer, connect) -> None:
    """nats-server admits a subscription to `cleave.roundcast.>` where `cleave.roundcast.*` is allowed (the
    literal `>` matches the `*`) and delivered it deeper subjects too, so a future subject below one of a
    worker's `*` patterns would have reached every worker. Their deeper subjects are denied: such a
    subscription gets what the `*` allows and nothing below it."""
    worker = await connect(server.settings("worker"), "worker")
    allowed = ["cleave.roundcast.j", "cleave.fan.j.1.g", SUBJECT_TILES.format(worker_id="w1")]
    got: list[str] = []
    all_in = asyncio.Event()

    async def on_msg(m) -> None:
        got.append(m.subject)
        if len(got) >= len(allowed):
            all_in.set()

    for pattern in ("cleave.roundcast.>", "cleave.fan.*.*.>", "cleave.tile.>"):
        await worker.nc.subscribe(pattern, cb=on_msg)
    await worker.nc.flush(timeout=OP_TIMEOUT_S)
    root = await nats.connect(server.url, nkeys_seed_str=server.admin_seed(), allow_reconnect=False,
                              connect_timeout=OP_TIMEOUT_S)
    try:  # the deeper ones first: had they passed, they would be in before the last allowed one
        for subject in [f"{s}.deeper" for s in allowed] + ["cleave.roundcast.j.x.y", *allowed]:
            await root.publish(subject, b"x")
        await root.flush(timeout=OP_TIMEOUT_S)
        await asyncio.wait_for(all_in.wait(), OP_TIMEOUT_S)
    finally:
        await root.close()
    assert sorted(got) == sorted(allowed) and worker.errors == []


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


async def test_the_runner_forgets_a_job_with_the_ps_credential(server: AuthServer, connect, tmp_path) -> None:
    """What the hub's runner deletes of a forgotten job (`cleave_cli.forget`), logged in as the PS: its record,
    checkpoint, head and events go; another job's stay; a worker may delete no event, nor purge any."""
    ps_c = await connect(server.settings("ps"), "ps")
    ps = Bus(ps_c.nc, "ps")
    async with asyncio.timeout(12 * OP_TIMEOUT_S):
        await ps.setup()
        jobs, state = await ps.kv(JOBS_BUCKET), await ps.kv(STATE_BUCKET, history=5)
        objects = await ps.object_store(STATE_OBJECTS)
        for job in ("gone", "kept"):
            await ps.kv_put(jobs, job, JobRecord(job_id=job, job="{}", state="done", submitted_at=1.0))
            await ps.kv_put(state, f"{job}.head", StateHead(job=job, step=0, epoch=1, object=f"{job}/ckpt",
                                                            sha256="0" * 64, size=1000, job_config="{}"))
            await objects.put(f"{job}/ckpt", b"\x01" * 1000)
            await ps.emit(StepMetrics(job=job, step=0, loss=1.0, step_time_s=0.1, workers=1))
            await ps.emit(Event(kind="ps_resumed", at=1.0, job=job, step=0))
        await ps.emit(Event(kind="worker_joined", at=1.0, worker_id="w9"))  # the fleet's: of no job
        (tmp_path / "gone").mkdir()
        gone = await forget.forget(ps, "gone", tmp_path / "gone", tmp_path / "ps-gone.log")
        assert (gone.checkpoints, gone.events, gone.paths) == (1, 2, (tmp_path / "gone",))
        assert await ps.kv_get(jobs, "gone", JobRecord) is None and await ps.kv_get(jobs, "kept", JobRecord)
        assert await ps.keys(state) == ["kept.head"]
        assert [o.name for o in await objects.list(ignore_deletes=True)] == ["kept/ckpt"]
        assert list(await hub.read_lasts(ps)) == ["kept"]
        left = await history.numbered(ps.js, EVENTS_STREAM, SUBJECT_EVENTS_ALL, Event, DeliverPolicy.ALL)
        assert [(e.kind, e.job) for _, e in left] == [("ps_resumed", "kept"), ("worker_joined", "")]
    assert ps_c.errors == []
    worker = await connect(server.settings("worker"), "worker")
    for subject, ask in ((f"$JS.API.STREAM.MSG.DELETE.{EVENTS_STREAM}", b'{"seq": 1}'),
                         (stream_purge(EVENTS_STREAM), b'{"filter": "cleave.events.*.kept"}')):
        await worker.nc.publish(subject, ask)
        assert "publish" in await worker.violation(subject)


async def watch_as_the_monitor(client: Client) -> None:
    """What the monitor runs: Bus.setup(), replay the events stream, watch the registry and the plan."""
    mon = Bus(client.nc, "monitor")
    await mon.setup()
    seen: asyncio.Queue = asyncio.Queue()

    async def on_event(msg) -> None:
        await seen.put(msg.subject)

    sub = await mon.js.subscribe(SUBJECT_EVENTS_ALL, stream=EVENTS_STREAM, cb=on_event, ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
    assert {await seen.get(), await seen.get()} == {"cleave.events.ps_resumed.~fleet",
                                                                   "cleave.events.plan_changed.~fleet"}
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
