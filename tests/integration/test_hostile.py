"""An attacker holding one pinned worker credential (`cleave auth init --worker-ids attacker,honest,...`) against
a real nats-server running the generated permissions, the real scheduler and, in the slow test, a real PS and
honest worker processes. Every attack is tried and fails: the scheduler stays up and planning, the buckets keep
what they held, no ghost worker appears, the model stays the reference's; what the attack costs the honest job
is measured (step time with and without the attacker) and printed.

The attacks (docs/security.md lists each defence with its test):
- probes whose reply names a plan key, a new plan key with 4 MiB echoes, the JetStream API, another's inbox;
- heartbeats as another worker or a ghost, profiles that are infinite, NaN, negative or absurd;
- results for another worker's attempt (given back or not), tiles never issued, wrong shapes, NaN, blocks that
  are not the product (+1000), zstd bombs (2 KB inflating to 63 MiB), blocks larger than any tile's, floods of
  chunk frames;
- as a verifier: silence, errors, cache misses, NaN;
- a profile claiming 100x the FLOPS it delivers;
- the JetStream API (consumers on the old models store), and model requests whose answers would go to another
  worker's subjects, the buckets or the JetStream API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import msgpack
import nats
import pytest
import torch
import zstandard
from nats.js.errors import KeyNotFoundError
from pydantic import model_validator

from cleave import auth, codec
from cleave import bus as busmod
from cleave.api.natsconf import free_port
from cleave.api.stack import Stack
from cleave.bus import receive
from cleave.models import gemm_shapes
from cleave.schemas import (
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    SUBJECT_HEARTBEAT,
    SUBJECT_LINKCHECK,
    SUBJECT_PROBE,
    SUBJECT_PROBE_FROM,
    SUBJECT_TILES,
    DeviceProfile,
    GemmSpec,
    Heartbeat,
    JobShapes,
    LinkCheck,
    LinkCheckAck,
    Plan,
    Probe,
    TileResult,
    TileTask,
    Wire,
)
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_cli import auth_cmd
from cleave_worker.core import BlockCache
from tests.integration.fleet import InProcessPS, assert_same
from tests.integration.test_auth import init_args, start_server

pytestmark = pytest.mark.timeout(180)
WORKERS = ("attacker", "honest", "honest2")
MAX_PAYLOAD = 128 * 1024  # small, so that result blocks travel in chunks
WAIT_S = 30.0
PROFILE = DeviceProfile(flops=2e10, memory_bytes=512 << 20, downlink_bytes_per_s=5e7, uplink_bytes_per_s=2e7,
                        latency_s=0.002)


@dataclass
class Hub:
    """The auth directory, its nats-server, a stack (the scheduler, workers) and an admin view of JetStream."""

    out: Path
    url: str
    stack: Stack
    admin: nats.NATS | None = None
    clients: list = field(default_factory=list)

    def seed(self, name: str, var: str = "") -> str:
        line = next(x for x in (self.out / f"{name}.env").read_text().splitlines() if x.startswith(var or "CLEAVE_"))
        return line.split("=", 1)[1]

    def worker_env(self, worker_id: str) -> dict[str, str]:
        return {"CLEAVE_WORKER_NATS_NKEY_SEED": self.seed(f"worker-{worker_id}")}

    def scheduler_env(self) -> dict[str, str]:
        return {"CLEAVE_SCHEDULER_NATS_NKEY_SEED": self.seed("scheduler"),
                "CLEAVE_SCHEDULER_PROBE_NKEY_SEED": self.seed("scheduler", "CLEAVE_SCHEDULER_PROBE_NKEY_SEED")}

    async def bus(self, role: str, name: str | None = None, worker_id: str | None = None) -> busmod.Bus:
        view = SimpleNamespace(nats_nkey_seed=self.seed(name or role), worker_id=worker_id)
        bus = await busmod.connect(self.url, f"test-{name or role}", **auth.connect_options(view, role))
        self.clients.append(bus)
        return bus

    async def stream_bytes(self, stream: str) -> int:
        if self.admin is None:
            self.admin = await receive.connect(self.url, nkeys_seed_str=(self.out / auth_cmd.ADMIN_NAME).read_text().strip())
        return (await self.admin.jetstream().stream_info(stream)).state.bytes

    def log(self, name: str) -> str:
        return (self.stack.run_dir / "logs" / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    out, port = tmp_path / "auth", free_port()
    auth_cmd.init(init_args(out, port, worker_ids=",".join(WORKERS), max_payload=MAX_PAYLOAD))
    server = start_server(out, tmp_path / "nats.log")
    stack = Stack(tmp_path / "run")
    stack.nats_url = f"nats://127.0.0.1:{port}"
    h = Hub(out, stack.nats_url, stack)
    try:
        yield h
    finally:
        stack.stop_all()
        server.terminate()
        server.wait(timeout=10)


def start_scheduler(hub: Hub) -> None:
    hub.stack.service("scheduler", "scheduler", env=hub.scheduler_env())
    deadline = time.monotonic() + WAIT_S
    while "scheduler_started" not in hub.log("scheduler"):
        assert time.monotonic() < deadline and hub.stack.procs["scheduler"].popen.poll() is None, hub.log("scheduler")
        time.sleep(0.05)


class Attacker:
    """A connection with the attacker's pinned credential that records what the server refused it."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.bus: busmod.Bus | None = None

    async def connect(self, hub: Hub) -> Attacker:
        async def on_error(e: Exception) -> None:
            self.violations.append(str(e).lower())

        view = SimpleNamespace(nats_nkey_seed=hub.seed("worker-attacker"), worker_id="attacker")
        nc = await receive.connect(hub.url, name="attacker", error_cb=on_error, **auth.connect_options(view, "worker"))
        self.bus = busmod.Bus(nc, "attacker")
        hub.clients.append(self.bus)
        return self

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        await self.bus.nc.publish(subject, data, reply=reply)

    async def refused(self, subject: str) -> None:
        """Until the server has reported a permissions violation naming `subject`."""
        async with asyncio.timeout(WAIT_S):
            while not any(subject.lower() in v for v in self.violations):
                await self.bus.nc.flush()
                await asyncio.sleep(0.02)  # (waiting for the server's -ERR, which carries no reply to await)


def raw_heartbeat(worker_id: str, **profile: float) -> bytes:
    """A heartbeat's bytes as any client can write them (pydantic would refuse to build these)."""
    body = {"worker_id": worker_id, "sent_at": time.time(), "started_at": 0.0,
            "profile": {**PROFILE.model_dump(), **profile}}
    return codec.MAGIC + bytes([codec.VERSION, 0]) + msgpack.packb(body, use_bin_type=True)


async def live_keys(bus: busmod.Bus, bucket: str) -> set[str]:
    """The bucket's keys that hold a value (listed by `Bus.keys`: nats-py's kv.keys() can find none on a busy
    server)."""
    kv, live = await bus.kv(bucket), set()
    for key in await bus.keys(kv):
        with contextlib.suppress(KeyNotFoundError):  # (a deleted key: its marker)
            await kv.get(key)
            live.add(key)
    return live


async def plan_where(bus: busmod.Bus, ok, timeout_s: float = WAIT_S) -> Plan:  # noqa: ANN001
    """The first published plan (current or later) for which `ok(plan)` holds."""
    kv = await bus.kv(PLAN_BUCKET)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await bus.kv_get(kv, PLAN_KEY, Plan)
        if got and ok(got[0]):
            return got[0]
        await asyncio.sleep(0.05)  # polling the bucket for the test's observation, not ordering anything
    raise TimeoutError("no such plan")


async def beat_while(bus: busmod.Bus, worker_id: str, stop: asyncio.Event, profile: DeviceProfile = PROFILE) -> None:
    while not stop.is_set():
        hb = Heartbeat(worker_id=worker_id, profile=profile, sent_at=time.time(), started_at=0.0)
        await bus.publish(SUBJECT_HEARTBEAT.format(worker_id=worker_id), hb)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def test_the_scheduler_shrugs_off_a_hostile_worker(hub: Hub) -> None:
    """Probes aimed at the buckets and the JetStream API, heartbeats as others and ghosts, infinite and absurd
    profiles: the scheduler answers nothing of it, its buckets keep what they held, and it goes on planning."""
    start_scheduler(hub)
    ps = await hub.bus("ps")  # reads plans and the registry, as the PS does
    attacker = await Attacker().connect(hub)
    honest = await hub.bus("worker", "worker-honest", "honest")
    stop, stop_attacker = asyncio.Event(), asyncio.Event()
    beats = [asyncio.create_task(beat_while(honest, "honest", stop)),
             asyncio.create_task(beat_while(attacker.bus, "attacker", stop_attacker))]
    try:
        plan = await plan_where(ps, lambda p: {w.worker_id for w in p.workers} == {"honest", "attacker"})
        plan_bytes = await hub.stream_bytes(f"KV_{PLAN_BUCKET}")
        probe = SUBJECT_PROBE_FROM.format(worker_id="attacker")
        # 1. probes whose reply is not the attacker's own inbox: a plan key, new plan keys with 4 MiB echoes,
        #    the JetStream API, another worker's inbox
        replies = [f"$KV.{PLAN_BUCKET}.{PLAN_KEY}", f"$JS.API.STREAM.PURGE.KV_{REGISTRY_BUCKET}",
                   f"$JS.API.STREAM.DELETE.KV_{PLAN_BUCKET}", "_INBOX.worker.honest.x.1",
                   *(f"$KV.{PLAN_BUCKET}.junk{i}" for i in range(8))]
        big = codec.encode(Probe(reply_bytes=4 * 1024 * 1024), compress=False)
        for reply in replies:
            await attacker.publish(probe, big, reply=reply)
        # ... on the old subject, or as another worker: refused by the server
        for subject in (SUBJECT_PROBE, SUBJECT_PROBE_FROM.format(worker_id="honest")):
            await attacker.publish(subject, big, reply=f"$KV.{PLAN_BUCKET}.{PLAN_KEY}")
            await attacker.refused(subject)
        # ... and its own probes are answered, within its budget: a flood draws at most the burst
        echoes = await attacker.bus.nc.subscribe("_INBOX.worker.attacker.flood.*")
        for i in range(320):
            await attacker.publish(probe, big, reply=f"_INBOX.worker.attacker.flood.{i}")
        # (an echo is at most max_payload here: 320 of them are 38 MiB, past the 32 MiB burst)
        await attacker.bus.request(probe, Probe(), Probe, timeout_s=WAIT_S)  # answered after the flood's probes
        await attacker.bus.nc.flush()
        answered = echoes.pending_msgs
        assert 200 < answered < 320, answered  # 32 MiB at once (1 MiB/s after): ~270 echoes of 124 KiB
        # 2. heartbeats as others, ghosts, and profiles no device has
        for name, profile in (("ghost-1", {}), ("honest", {"flops": 1e6, "latency_s": 10.0}),
                              ("attacker", {"flops": float("inf")}), ("attacker", {"flops": float("nan")}),
                              ("attacker", {"flops": -1.0}), ("attacker", {"latency_s": 1e9}),
                              ("attacker", {"downlink_bytes_per_s": 1e300}), ("attacker", {"memory_bytes": 2**62})):
            await attacker.publish(SUBJECT_HEARTBEAT.format(worker_id="attacker"), raw_heartbeat(name, **profile))
        await attacker.publish(SUBJECT_HEARTBEAT.format(worker_id="honest"), raw_heartbeat("honest", flops=1e6))
        await attacker.refused(SUBJECT_HEARTBEAT.format(worker_id="honest"))
        # everything it sent has been handled once the scheduler saw it leave (its heartbeats come in order)
        stop_attacker.set()
        after = await plan_where(ps, lambda p: {w.worker_id for w in p.workers} == {"honest"})
        assert after.version > plan.version  # it goes on planning
        assert next(w for w in after.workers if w.worker_id == "honest").profile == PROFILE  # not rewritten
        assert await live_keys(ps, REGISTRY_BUCKET) == {"honest"}  # no ghost, not purged
        assert await live_keys(ps, PLAN_BUCKET) == {PLAN_KEY}  # no junk keys; the current plan is a Plan
        assert await hub.stream_bytes(f"KV_{PLAN_BUCKET}") < plan_bytes + 64 * 1024  # no 4 MiB echo in it
        assert hub.stack.procs["scheduler"].popen.poll() is None and "Traceback" not in hub.log("scheduler")
        log = hub.log("scheduler")
        for reason in ("reply_refused", "wrong_sender", "bad_schema"):
            assert f"reason={reason}" in log, reason
    finally:
        stop.set()
        stop_attacker.set()
        await asyncio.gather(*beats)
        for c in hub.clients:
            await c.close()
        if hub.admin is not None:
            await hub.admin.close()


# ---- a hostile member of the fleet during training ---------------------------------------------------
MODES = ("silent", "error", "missing", "nan", "shape", "bomb", "chunks", "huge", "late", "spray")


class HostileWorker:
    """The attacker as the PS sees it: a member of the plan (it heartbeats a plausible profile and answers link
    checks) whose answers to its tiles are attacks. `mode`: "stall" cycles through MODES, one per tile; "lie"
    returns its product with +1000 in one element; "slow" returns correct blocks, `delay_s` late."""

    def __init__(self, attacker: Attacker, profile: DeviceProfile = PROFILE) -> None:
        self.a, self.profile = attacker, profile
        self.mode, self.delay_s = "stall", 0.0
        self.cache = BlockCache(1 << 30)
        self.tried: dict[str, int] = {}
        self.sprayed: set[int] = set()
        self.mine: set[tuple[int, int, int]] = set()  # (gemm, tile, attempt) it was dealt
        self.tasks: set[asyncio.Task] = set()
        self.bomb: bytes | None = None

    async def start(self, stop: asyncio.Event) -> None:
        bus = self.a.bus
        self.subs = [await bus.subscribe(SUBJECT_TILES.format(worker_id="attacker"), TileTask, self.on_tile),
                     await bus.serve(SUBJECT_LINKCHECK.format(worker_id="attacker"), LinkCheck, self.on_check,
                                     max_bytes=1 << 21)]
        self.beating = asyncio.create_task(beat_while(bus, "attacker", stop, self.profile))

    async def on_check(self, check: LinkCheck) -> LinkCheckAck:
        return LinkCheckAck(worker_id="attacker")

    async def on_tile(self, task: TileTask, nbytes: int) -> None:
        self.mine.add((task.gemm, task.tile, task.attempt))
        a, bt = self.cache.resolve(task.a), self.cache.resolve(task.b)
        mode = self.mode
        if mode == "stall":
            mode = MODES[sum(self.tried.values()) % len(MODES)]
        self.tried[mode] = self.tried.get(mode, 0) + 1
        if a is None or bt is None:
            return await self.send(task, missing=(task.a.id,))
        block = a.float() @ bt.float().T
        if mode in ("silent",):
            return None
        if mode == "error":
            return await self.send(task, error="no")
        if mode == "missing":
            return await self.send(task, missing=(task.a.id,))
        if mode == "nan":
            return await self.send(task, out=torch.full_like(block, float("nan")))
        if mode == "shape":
            return await self.send(task, out=torch.zeros(block.shape[0] + 1, block.shape[1]))
        if mode == "spray":  # a result for every other tile and attempt of this GEMM: others' (given back or not),
            # unknown ones; 1 x 1, the shape of no tile, so that one dealt to it but still on its way is refused
            # as misshapen instead of caught as a lie (which would expel it before the other attacks)
            if task.gemm not in self.sprayed:
                self.sprayed.add(task.gemm)
                for tile in range(64):
                    for attempt in range(3):
                        if (task.gemm, tile, attempt) not in self.mine:
                            await self.send(task.model_copy(update={"tile": tile, "attempt": attempt}),
                                            out=torch.full((1, 1), 666.0))
            return await self.send(task, out=block)
        if mode == "bomb":  # 2 KB of zstd inflating to 63 MiB, on its own result subject
            await self.a.publish(task.reply, self.zstd_bomb(task))
            return await self.send(task, out=block)
        if mode == "chunks":  # 64 chunk frames, each a message of its own, never completed
            for _ in range(64):
                frame = codec.split(codec.encode(TileResult(job=task.job, epoch=task.epoch, step=task.step, op=task.op,
                                                            tile=0, attempt=0, worker_id="attacker", error="x" * 600),
                                                 compress=False), 256)[0]
                await self.a.publish(task.reply, frame)
            return await self.send(task, out=block)
        if mode == "huge":  # a block 16x the size of any of this epoch's: refused before it is put together
            await self.send(task, out=torch.zeros(block.shape[0] * 4, block.shape[1] * 4))
            return await self.send(task, out=block)
        if mode == "lie":
            block[0, 0] += 1000.0
            return await self.send(task, out=block)
        if mode in ("late", "slow"):  # answered after its deadline (given back: only its own answer counts)
            self.later(task, block, 1.5 if mode == "late" else self.delay_s)
        return None

    def later(self, task: TileTask, block: torch.Tensor, delay_s: float) -> None:
        async def answer() -> None:
            await asyncio.sleep(delay_s)  # (the attack is the delay itself)
            await self.send(task, out=block)

        t = asyncio.create_task(answer())
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def send(self, task: TileTask, out: torch.Tensor | None = None, **fields) -> None:
        msg = TileResult(job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
                         attempt=task.attempt, worker_id="attacker",
                         out=None if out is None else codec.tensor_to_data(out), **fields)
        await self.a.bus.publish(task.reply, msg, compress=False)

    def zstd_bomb(self, task: TileTask) -> bytes:
        if self.bomb is None:
            body = {"job": task.job, "epoch": task.epoch, "step": task.step, "op": task.op, "gemm": task.gemm,
                    "tile": task.tile, "attempt": task.attempt, "worker_id": "attacker",
                    "out": {"dtype": "float32", "shape": [4032, 4096], "data": bytes(63 * 1024 * 1024)}}
            packed = msgpack.packb(body, use_bin_type=True)
            self.bomb = codec.MAGIC + bytes([codec.VERSION, codec.FLAG_ZSTD]) + zstandard.ZstdCompressor().compress(packed)
        return self.bomb

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        for s in self.subs:
            await s.unsubscribe()


async def timed_steps(ps: InProcessPS, trainer: Trainer, steps: range) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for s in steps:
        t0 = time.perf_counter()
        losses.append(await asyncio.wait_for(ps.step(lambda s=s: trainer.step(s), s), 120))
        times.append(time.perf_counter() - t0)
    return losses, times


async def honest_fleet(hub: Hub, ids: tuple[str, ...] = ("honest", "honest2")) -> None:
    """The scheduler and honest worker processes, each with its own pinned credential (they measure their
    FLOPS and probe their links through the scheduler's probe echo)."""
    start_scheduler(hub)
    for w in ids:
        hub.stack.service(w, "worker", ["--worker-id", w], env=hub.worker_env(w))


STALLED = {"wrong_worker", "unknown_tile", "bad_shape", "not_finite", "worker_error", "zstd_refused", "too_large"}
REFUSED = STALLED | {"wrong_block"}  # what the PS logs refusing the attacks of MODES, then the lie


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_hostile_member_cannot_spoil_or_stall_training(hub: Hub) -> None:
    """The attacker joins the plan, then stalls and forges (every mode of MODES, as a worker and as a
    verifier), then lies: the model stays the reference's, the liar is expelled by Freivalds' check, and the
    honest job's step time is measured without the attacker, while it attacks, and after it is expelled."""
    job = JobConfig(preset="tiny", steps=40)  # (the most it may take: it attacks until each attack was seen)
    await honest_fleet(hub)
    ps_view = SimpleNamespace(nats_nkey_seed=hub.seed("ps"))
    attacker = await Attacker().connect(hub)
    hostile, stop = HostileWorker(attacker), asyncio.Event()
    try:
        async with InProcessPS(hub.url, connect=auth.connect_options(ps_view, "ps"), verify_fraction=0.25) as ps:
            await ps.wait_workers(2)
            dist = Trainer(job, ps.backend)
            got, quiet = await timed_steps(ps, dist, range(0, 4))
            await hostile.start(stop)
            await ps.wait_workers(3)
            attacked: list[float] = []
            s, d, reasons = 4, ps.dispatcher, ps.bus.rejected
            # each attack until it was both made and refused (a spray can land after its GEMM ended: dropped
            # as late, not refused as unknown), then lies until Freivalds' check, which samples a quarter of
            # the blocks, catches one
            while s < job.steps - 12 and (s < 6 or set(MODES) - set(hostile.tried) or STALLED - set(reasons)):
                loss, t = await timed_steps(ps, dist, range(s, s + 1))
                got, attacked, s = got + loss, attacked + t, s + 1
            assert set(hostile.tried) >= set(MODES), hostile.tried
            hostile.mode = "lie"
            while s < job.steps - 2 and "attacker" not in d.faulty:
                loss, _ = await timed_steps(ps, dist, range(s, s + 1))
                got, s = got + loss, s + 1
            loss, after = await timed_steps(ps, dist, range(s, s + 2))  # expelled: the honest job alone again
            got += loss
        reference = Trainer(job)
        assert_same(got, [reference.step(i) for i in range(len(got))])
        assert d.faulty == {"attacker"} and "attacker" not in d.workers
        assert set(reasons) >= REFUSED, reasons
        assert d.c.verified > 0 and d.verifier.done > 0
        assert hub.stack.procs["scheduler"].popen.poll() is None
        report = {"quiet_step_s": statistics.median(quiet), "attacked_step_s": statistics.median(attacked),
                  "after_expelled_step_s": statistics.median(after), "attacked_steps": len(attacked),
                  "verified_blocks": d.c.verified, "verify_cpu_s": d.c.verify_cpu_s, "checks_judged_alone":
                  d.verifier.alone, "rejected": dict(reasons)}
        print("hostile worker's cost to the honest job:", json.dumps(report, indent=1))
    finally:
        stop.set()
        await hostile.close()
        for c in hub.clients:
            await c.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_profile_claiming_far_more_than_it_delivers_is_corrected(hub: Hub) -> None:
    """The attacker claims 1 TFLOP/s and 10 GB/s links and delivers each block 0.3 s late: the cost-aware plan
    gives it the largest share, the PS reports what it delivered, and the scheduler plans it, from then on, at
    that (`profile_corrected`); the honest job's steps before and after are printed."""
    job = JobConfig(preset="tiny", steps=40)  # a bound: it stops 3 steps after the correction
    await honest_fleet(hub, ("honest",))
    claim = PROFILE.model_copy(update={"flops": 1e12, "downlink_bytes_per_s": 1e10, "uplink_bytes_per_s": 1e10,
                                       "latency_s": 0.0})
    ps_view = SimpleNamespace(nats_nkey_seed=hub.seed("ps"))
    attacker = await Attacker().connect(hub)
    hostile, stop = HostileWorker(attacker, claim), asyncio.Event()
    hostile.mode, hostile.delay_s = "slow", 0.3
    try:
        async with InProcessPS(hub.url, connect=auth.connect_options(ps_view, "ps")) as ps:
            specs = tuple(GemmSpec(name=g.name, m=g.m, n=g.n, k=g.k, count_per_step=g.count_per_step)
                          for g in gemm_shapes(job.arch(), job.batch_size, job.seq))
            await ps.bus.kv_put(await ps.bus.kv(PLAN_BUCKET), SHAPES_KEY, JobShapes(job=job.job_id, gemms=specs))
            await ps.wait_workers(1)
            await hostile.start(stop)
            await ps.wait_workers(2)
            dist, got, before, after = Trainer(job, ps.backend), [], [], []
            for s in range(job.steps):
                loss, t = await timed_steps(ps, dist, range(s, s + 1))
                member = ps.dispatcher.dealer.members.get("attacker")
                corrected = member is not None and member.profile.flops < claim.flops / 8
                got, before, after = got + loss, before + (t if not after and not corrected else []), after + \
                    (t if corrected else [])
                if len(after) >= 3:
                    break
            member = ps.dispatcher.dealer.members["attacker"]
        assert member.profile.flops < claim.flops / 8, member.profile  # planned at what it delivers
        assert "profile_corrected" in hub.log("scheduler")
        reference = Trainer(job)
        assert_same(got, [reference.step(i) for i in range(len(got))])
        print("overclaiming worker:", json.dumps({
            "claimed_flops": claim.flops, "planned_flops_after": member.profile.flops,
            "step_s_before_correction": [round(t, 3) for t in before], "step_s_after": [round(t, 3) for t in after]}))
    finally:
        stop.set()
        await hostile.close()
        for c in hub.clients:
            await c.close()


async def test_a_worker_gets_no_jetstream_and_model_answers_only_in_its_own_inbox(hub: Hub, tmp_path: Path) -> None:
    """A worker fetches a job's base weights from the PS by request, and the PS answers only on the requester's
    own inbox. The attacker's JetStream calls (consumers and message gets on the old models store, which an
    older hub may still hold, and any other API) are refused by the server; its model requests whose reply
    names another worker's result subject or inbox, the plan key, the registry's purge, the PS's replies or a
    look-alike of its own inbox are refused by the PS (`reply_refused`), which delivers nothing there, changes no
    bucket and goes on serving."""
    from cleave.models import bundles
    from cleave.schemas import SUBJECT_MODELS_GET, SUBJECT_RESULTS, ModelsGet, ModelsPart

    ps = await hub.bus("ps")
    await ps.setup()
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    shelf = bundles.Shelf()
    bid = await shelf.publish(ps, "model", [base / "model.safetensors"])
    hub.admin = await receive.connect(hub.url, nkeys_seed_str=(hub.out / auth_cmd.ADMIN_NAME).read_text().strip())
    js = hub.admin.jetstream()
    await (await js.create_object_store("cleave-models")).put("base.bin", bytes(range(256)) * 4096)
    await (await js.key_value(PLAN_BUCKET)).put(PLAN_KEY, b"the plan")
    await (await js.key_value(REGISTRY_BUCKET)).put("honest", b"a record")
    buckets = [f"KV_{PLAN_BUCKET}", f"KV_{REGISTRY_BUCKET}", "OBJ_cleave-models"]
    before = {b: (await js.stream_info(b)).state for b in buckets}
    attacker = await Attacker().connect(hub)
    try:
        # 1. the JetStream API: refused by the server, whatever the call and the stream
        stream, created = "OBJ_cleave-models", json.dumps({"stream_name": "OBJ_cleave-models", "config": {
            "deliver_subject": SUBJECT_RESULTS.format(job="j", epoch=1, worker_id="honest"), "deliver_policy": "all",
            "ack_policy": "none"}}).encode()
        for subject in (f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.c1.$O.cleave-models.C.>",
                        f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.STREAM.INFO.{stream}",
                        "$JS.API.STREAM.NAMES", "$JS.API.INFO", f"$JS.API.STREAM.PURGE.KV_{REGISTRY_BUCKET}"):
            await attacker.publish(subject, created, reply="_INBOX.worker.attacker.js.1")
            await attacker.refused(subject)
        # 2. model requests answered elsewhere than its own inbox: nothing arrives there
        aimed = [SUBJECT_RESULTS.format(job="j", epoch=1, worker_id="honest"), f"$KV.{PLAN_BUCKET}.{PLAN_KEY}",
                 f"$JS.API.STREAM.PURGE.KV_{REGISTRY_BUCKET}", f"$JS.API.STREAM.DELETE.KV_{PLAN_BUCKET}",
                 "_INBOX.worker.honest.x.1", "_INBOX.ps.w.abc.def", "_INBOX.worker.attackerX.1", "_INBOX.worker.attacker"]
        watches = [await hub.admin.subscribe(a) for a in aimed]
        await hub.admin.flush()
        own = SUBJECT_MODELS_GET.format(worker_id="attacker")
        for kind, sha in (("bundle", bid), ("file", bundles.describe_file(base / "model.safetensors").sha256)):
            ask = codec.encode(ModelsGet(kind=kind, sha256=sha, length=64 * 1024), compress=False)
            for reply in aimed:
                await attacker.publish(own, ask, reply=reply)
        await attacker.publish(own, b"not a request", reply="_INBOX.worker.attacker.junk.1")  # refused as malformed
        # ... and it is still served on its own inbox, after all of them (one subscription, in order)
        part = await attacker.bus.request(own, ModelsGet(kind="bundle", sha256=bid, length=1024), ModelsPart,
                                          timeout_s=WAIT_S)
        assert part.size > 0 and part.data
        await hub.admin.flush()
        assert [w.pending_msgs for w in watches] == [0] * len(aimed)
        assert ps.rejected == {"reply_refused": 2 * len(aimed), "bad_magic": 1}, ps.rejected
        # 3. the honest worker fetches the whole bundle; nothing of the buckets changed
        honest = await hub.bus("worker", "worker-honest", "honest")
        got = await bundles.BundleCache(tmp_path / "cache", "honest").fetch(honest, bid)
        assert (got / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
        for b in buckets:
            state = (await js.stream_info(b)).state
            assert (state.messages, state.bytes, state.last_seq) == (before[b].messages, before[b].bytes,
                                                                     before[b].last_seq), b
            assert (await js.stream_info(b)).state.consumer_count == 0, b
        assert (await (await js.key_value(PLAN_BUCKET)).get(PLAN_KEY)).value == b"the plan"
        assert await live_keys(busmod.Bus(hub.admin, "admin"), REGISTRY_BUCKET) == {"honest"}
    finally:
        for c in hub.clients:
            await c.close()
        await hub.admin.close()


async def test_every_stream_and_bucket_is_bounded(nats_url: str) -> None:
    """What `Bus.setup()` and the hub's runner create has a size limit and a largest message, so no writer,
    whatever it was made to write, grows them without bound (the checkpoint store: `CLEAVE_PS_STATE_MAX_BYTES`
    where the PS creates it)."""
    from cleave.schemas import EVENTS_STREAM, JOBS_BUCKET, JOBS_STREAM, STATE_BUCKET, STATE_OBJECTS
    from cleave_cli.runner import jobs_stream

    bus = await busmod.connect(nats_url, "setup")
    try:
        await bus.setup()
        await jobs_stream(bus)
        await bus.kv(JOBS_BUCKET)
        await bus.object_store(STATE_OBJECTS, max_bytes=1 << 30)
        buckets = (REGISTRY_BUCKET, PLAN_BUCKET, STATE_BUCKET, JOBS_BUCKET)
        for stream in (EVENTS_STREAM, JOBS_STREAM, *(f"KV_{b}" for b in buckets)):
            config = (await bus.js.stream_info(stream)).config
            assert 0 < config.max_bytes <= 1 << 30 and 0 < config.max_msg_size <= 8 << 20, (stream, config)
        assert (await bus.js.stream_info(f"OBJ_{STATE_OBJECTS}")).config.max_bytes == 1 << 30
    finally:
        await bus.close()


class Traced(Wire):
    """A message that notes which thread validated it."""

    data: bytes = b""

    @model_validator(mode="after")
    def _where(self) -> Traced:
        DECODED_ON.append(threading.current_thread())
        return self


DECODED_ON: list[threading.Thread] = []


async def test_large_messages_are_decoded_off_the_event_loop(nats_url: str) -> None:
    """A message over `bus.OFF_LOOP_BYTES` is decoded (and validated) in a worker thread: a worker's 60 MiB
    result costs the PS's event loop nothing but the hand-over."""
    bus = await busmod.connect(nats_url, "decoder")
    got: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg: Traced, nbytes: int) -> None:
        await got.put(nbytes)

    try:
        await bus.subscribe("test.decode", Traced, on_msg)
        await bus.nc.flush()
        messages = [Traced(data=bytes(size)) for size in (1000, 2 * busmod.OFF_LOOP_BYTES)]
        DECODED_ON.clear()  # (building them validated them here)
        for msg in messages:
            await bus.publish("test.decode", msg, compress=False)
            await asyncio.wait_for(got.get(), WAIT_S)
        small, large = DECODED_ON
        assert small is threading.main_thread() and large is not threading.main_thread()
    finally:
        await bus.close()
