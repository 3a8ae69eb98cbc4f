"""The simulator and the PS deal alike: a GEMM simulated with a device lost midway is recorded event by event
(plans, results, checks, at their simulated times), replayed into the PS's real Dispatcher (its clock set to
the recorded times, its tiles and fan-out blocks encoded as for NATS and read back), and every tile it sends,
to whom, which attempt, whether its input blocks travel with it and which are published to their fan-out
group, is what the simulator's dealer decided."""

import asyncio

import numpy as np
import torch

from cleave import codec
from cleave.gemm.dealer import Dealer, Policy, Send
from cleave.gemm.engine import OneGemm, fleet_of
from cleave.plan.fleet import synthetic_fleet
from cleave.schemas import (
    SUBJECT_LINKCHECK,
    BlockPush,
    DeviceProfile,
    FanoutAck,
    GemmLayout,
    LinkCheckAck,
    Plan,
    PlanWorker,
    TileResult,
    TileTask,
)
from cleave.sim import plans as simplans
from cleave.sim.world import World
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.settings import PsSettings

M, N, K, B, TILE, CHUNKS, CACHE = 192, 256, 32, 4, 64, 2, 1 << 20


class Recording(Dealer):
    """The simulator's dealer, writing down what it is told and what it decides."""

    def __init__(self, policy):
        super().__init__(policy)
        self.events: list[tuple] = []

    def _log(self, event, sends):
        self.events.append((event, [(s.worker, s.tile.index, s.attempt, s.a.data, s.a.publish, s.b.data, s.b.publish)
                                    for s in sends if isinstance(s, Send)]))
        return sends

    def set_fleet(self, fleet, now, cause="heartbeat_timeout"):
        fleet = list(fleet)
        return self._log(("plan", now, tuple(w for w, _, _ in fleet)), super().set_fleet(fleet, now, cause))

    def begin(self, work, now, priority=0):
        return self._log(("begin", now), super().begin(work, now, priority))

    def done(self, worker, tile, attempt, now, seq=None):
        outcome, sends = super().done(worker, tile, attempt, now, seq)
        self._log(("done", now, worker, tile, attempt), sends)
        return outcome, sends

    def tick(self, now):
        return self._log(("tick", now), super().tick(now))

    def proved(self, worker, now):
        return self._log(("proved", now, worker), super().proved(worker, now))


class Wire:
    """Where the Dispatcher publishes: every frame decoded back into the TileTask a worker would get."""

    def __init__(self):
        self.on_dropped = []
        self.sent: list[tuple] = []
        self.pushed: set[str] = set()  # ids of the blocks published to a group, just before their tile
        self.published = asyncio.Event()

    async def settled(self):  # what publish_pieces took is decoded already
        pass

    async def publish_pieces(self, subject, pieces, wait=True):
        frame = b"".join(pieces)
        if subject.startswith("cleave.fan."):
            self.pushed.add(codec.decode(frame, BlockPush).block.id)
            return len(frame)
        task = codec.decode(frame, TileTask)
        worker = subject.rsplit(".", 1)[1]
        a, b = task.a, task.b
        self.sent.append((worker, task.tile, task.attempt, a.tensor is not None, a.id in self.pushed,
                          b.tensor is not None, b.id in self.pushed))
        self.pushed.clear()
        self.published.set()
        return len(frame)

    async def request(self, subject, join, schema, timeout_s):
        """A worker joining every fan-out group it is asked to; link checks are answered when the replay
        says the simulator's came back (`proved`)."""
        if subject.startswith(SUBJECT_LINKCHECK.split("{")[0]):
            raise TimeoutError("the replay proves links")
        return FanoutAck(worker_id=subject.rsplit(".", 1)[1], joined=join.subjects)

    def reject(self, *args):
        raise AssertionError(f"the PS rejected a replayed result: {args}")


def simulate(policy):
    world = World.build(synthetic_fleet(6, seed=4))
    cutter = simplans.Cutter(world, B, "cost", (TILE, TILE), CHUNKS, window=policy.window, cache_bytes=CACHE)
    first = simplans.PublishedPlan(0.0, np.arange(len(world)))
    ts, predicted = cutter.tileset(0, first, M, N, K)
    gp = cutter.gemm_plan(0, first, M, N, K)
    r0, r1, c0, c1 = (gp.row0, gp.row1, gp.col0, gp.col1) if M <= N else (gp.col0, gp.col1, gp.row0, gp.row1)
    boxes = [int(v) for box in zip(r0, r1, c0, c1, strict=True) for v in box]
    owners = [world.ids[d] for d in gp.dev.tolist()]

    def fleet(ids):
        return fleet_of(ids, world.index, world.declared, CACHE)

    dealer = Recording(policy)
    dealer.set_fleet(fleet(world.ids), 0.0)
    leave_at = np.full(len(world), np.inf)
    victim, frozen = owners[0], next(o for o in owners if o != owners[0])  # one leaves, one just stops
    fresh = Dealer(policy)
    fresh.set_fleet(fleet(world.ids), 0.0)
    clean = OneGemm(ts, 0.0, fresh, world.index, world.actual, leave_at.copy(), np.zeros((len(world), 3)),
                    fleet, 1).run()
    leave_at[world.index[victim]] = clean.last[world.index[victim]] / 2
    leave_at[world.index[frozen]] = clean.last[world.index[frozen]] / 3
    later = [(float(leave_at[world.index[victim]]) + 0.1, tuple(w for w in world.ids if w != victim))]
    dealer.set_fleet(fleet(world.ids), 0.0)
    dealer.events.clear()
    out = OneGemm(ts, 0.0, dealer, world.index, world.actual, leave_at, np.zeros((len(world), 3)), fleet, 1,
                  later).run()
    layout = GemmLayout(m=M, n=N, k=K, boxes=tuple(boxes), owners=tuple(owners), makespan_s=predicted)
    profiles = {w: p for w, _, p in fleet(world.ids)}
    return dealer.events, out, layout, profiles


def plan_of(ids, layout, profiles, version):
    workers = tuple(PlanWorker(worker_id=w, profile=profiles[w], cache_bytes=CACHE) for w in ids)
    return Plan(version=version, created_at=0.0, workers=workers, tile_rows=TILE, tile_cols=TILE, chunks=CHUNKS,
                gemms=(layout,) if layout else ())


async def replay(events, layout, profiles, policy):
    wire, clock = Wire(), [0.0]
    d = Dispatcher(wire, "job", 1, PsSettings(tick_s=1e6))  # it ticks only when the replay says so
    d.dealer = Dealer(policy)  # the simulated run's policy, every part of it
    d.clock = lambda: clock[0]
    await d.set_plan(plan_of(profiles, layout, profiles, 1))
    await d._joining
    assert any(d.dealer.groups.joined.values())  # the fan-out groups are joined
    decided = []
    a, bt = torch.randn(M, K), torch.randn(N, K)
    gemm = asyncio.create_task(d.gemm(a, bt, step=1, op=1, name="x"))
    for i, ((kind, now, *args), sends) in enumerate(events):
        clock[0] = now
        before = len(wire.sent)
        if kind == "begin":
            while len(wire.sent) < len(sends):  # the GEMM task deals its first tiles
                await asyncio.wait_for(wire.published.wait(), 10)
                wire.published.clear()
        elif kind == "done":
            worker, tile, attempt = args
            t = d.dealer.deal().ledger.tiles[tile]
            out = codec.tensor_to_data(a[t.r0 : t.r1] @ bt[t.c0 : t.c1].T)  # the true block: it passes the checks
            await d.on_result(TileResult(job="job", epoch=1, step=1, op=1, gemm=d.run.seq, tile=tile,
                                         attempt=attempt, worker_id=worker, out=out), 0)
        elif kind == "tick":
            await d._tick()
        elif kind == "proved":
            await d.post(d.dealer.proved(args[0], now))
        else:
            await d.set_plan(plan_of(args[0], None, profiles, 2 + i))  # its layout is for later GEMMs
        decided.append(((kind, now, *args), wire.sent[before:]))
    await asyncio.wait_for(gemm, 10)
    return decided


async def test_the_simulator_and_the_ps_make_the_same_decisions():
    policy = Policy(window=2, tile_timeout_s=0.5, speculate_factor=3.0, speculate_min_s=0.2)
    events, out, layout, profiles = simulate(policy)
    kinds = {e[0][0] for e in events}
    assert {"begin", "done", "tick", "plan"} <= kinds and out.recoveries  # a loss, checks and a new plan
    assert out.resent >= 1  # tiles were sent again
    assert any(send[4] or send[6] for _, sends in events for send in sends)  # blocks published to groups
    assert await replay(events, layout, profiles, policy) == events


async def test_the_ps_checks_a_suspects_link_before_dealing_it_again():
    """The PS's shell of the rule `test_a_suspect_retried_gets_tiles_only_once_its_link_is_proven` checks:
    when a suspect's retry time comes, a link check goes to it over its tile connection, and its next tile
    only once the check is answered."""

    class Checked(Wire):
        def __init__(self):
            super().__init__()
            self.checked, self.answer = [], asyncio.Event()

        async def request(self, subject, msg, schema, timeout_s):
            if not subject.startswith(SUBJECT_LINKCHECK.split("{")[0]):
                return await super().request(subject, msg, schema, timeout_s)
            self.checked.append(subject.rsplit(".", 1)[1])
            await self.answer.wait()
            return LinkCheckAck(worker_id=self.checked[-1])

    wire, clock = Checked(), [0.0]
    d = Dispatcher(wire, "job", 1, PsSettings(tick_s=1e6, fanout=False))  # it ticks only when the test says so
    d.dealer = Dealer(Policy(window=1, tile_timeout_s=1.0, speculate_factor=0, suspect_retry=2.0))
    d.clock = lambda: clock[0]
    profiles = {w: DeviceProfile(flops=1e9, memory_bytes=1 << 30, downlink_bytes_per_s=1e7, uplink_bytes_per_s=1e7,
                                 latency_s=0.01) for w in ("a", "b")}
    await d.set_plan(plan_of(profiles, None, profiles, 1))
    gemm = asyncio.create_task(d.gemm(torch.randn(256, 16), torch.randn(256, 16), step=1, op=1, name="x"))
    while len(wire.sent) < 2:
        await asyncio.wait_for(wire.published.wait(), 10)
        wire.published.clear()
    clock[0] = 1.01
    await d._tick()  # both silent for a tile timeout: suspect
    assert all(m.suspect for m in d.dealer.members.values())
    clock[0] = 3.02
    before = len(wire.sent)
    await d._tick()  # their retry: checked, not dealt to
    for _ in range(20):
        await asyncio.sleep(0)
    assert sorted(wire.checked) == ["a", "b"] and len(wire.sent) == before
    wire.answer.set()
    while len(wire.sent) < before + 2:
        await asyncio.wait_for(wire.published.wait(), 10)
        wire.published.clear()
    assert {s[0] for s in wire.sent[before:]} == {"a", "b"}
    d.stopping = True
    gemm.cancel()
    await asyncio.gather(gemm, return_exceptions=True)
