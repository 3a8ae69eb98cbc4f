"""The PS's dispatcher without a bus: GEMM fencing (a step redone after a lying worker was caught runs its
GEMMs again under the same (step, op); a late result from the first run must never be assembled into the
second), and results the bus dropped unread (a slow consumer) dealt again at once."""

import asyncio

import torch

from cleave import codec
from cleave.errors import StepSpoiled
from cleave.schemas import SUBJECT_RESULTS, DeviceProfile, Plan, PlanWorker, TileResult, TileTask
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.settings import PsSettings

PROFILE = DeviceProfile(flops=1e9, memory_bytes=1 << 30, downlink_bytes_per_s=1e7, uplink_bytes_per_s=1e7,
                        latency_s=0.01)


class Wire:
    def __init__(self):
        self.on_dropped = []
        self.tasks: list[tuple[str, TileTask]] = []
        self.published = asyncio.Event()
        self.rejected: list[str] = []

    async def publish_frame(self, subject, frame):
        self.tasks.append((subject.rsplit(".", 1)[1], codec.decode(frame, TileTask)))
        self.published.set()
        return len(frame)

    def reject(self, reason, *args):
        self.rejected.append(reason)

    async def wait_for(self, count):
        while len(self.tasks) < count:
            self.published.clear()
            await asyncio.wait_for(self.published.wait(), 10)


def result(task: TileTask, worker: str, block: torch.Tensor) -> TileResult:
    return TileResult(job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
                      attempt=task.attempt, worker_id=worker, out=codec.tensor_to_data(block))


async def test_a_late_result_of_a_spoiled_run_never_reaches_the_redone_gemm():
    wire = Wire()
    d = Dispatcher(wire, "job", 1, PsSettings(window=1, tick_s=1e6))
    workers = tuple(PlanWorker(worker_id=w, profile=PROFILE, cache_bytes=1 << 20) for w in ("a", "b"))
    await d.set_plan(Plan(version=1, created_at=0.0, workers=workers, tile_rows=4, tile_cols=4))
    a, bt = torch.randn(4, 8), torch.randn(8, 8)  # two 4x4 tiles: one for a, one for b
    truth = a @ bt.T

    first = asyncio.create_task(d.gemm(a, bt, step=3, op=1, name="x"))
    await wire.wait_for(2)
    (_, t_a), (_, t_b) = wire.tasks
    d.run.spoiled = "a"  # as when a verification catches a liar: the step is redone without it
    d.run.done.set()
    try:
        await asyncio.wait_for(first, 10)
        raise AssertionError("the spoiled GEMM returned")
    except StepSpoiled:
        pass

    second = asyncio.create_task(d.gemm(a, bt, step=3, op=1, name="x"))  # same step, same op
    await wire.wait_for(4)
    redo = {task.tile: (w, task) for w, task in wire.tasks[2:]}
    assert all(task.gemm == t_a.gemm + 1 for _, task in redo.values())
    # b's answer to the first run comes late, for a tile and attempt the second run has issued too
    stale = result(t_b, "b", torch.full((4, 4), 666.0))
    assert (t_b.tile, t_b.attempt) in {(task.tile, task.attempt) for _, task in redo.values()}
    await d.on_result(stale, 0)
    assert d.c.fenced == 1 and not d.dealer.deal().ledger.done
    for tile, (w, task) in redo.items():
        t = d.dealer.deal().ledger.tiles[tile]
        await d.on_result(result(task, w, truth[t.r0 : t.r1, t.c0 : t.c1]), 0)
    out = await asyncio.wait_for(second, 10)
    assert torch.equal(out, truth)


async def test_results_dropped_by_the_bus_are_dealt_again_at_once():
    wire = Wire()
    d = Dispatcher(wire, "job", 1, PsSettings(window=1, tick_s=1e6))
    workers = tuple(PlanWorker(worker_id=w, profile=PROFILE, cache_bytes=1 << 20) for w in ("a", "b"))
    await d.set_plan(Plan(version=1, created_at=0.0, workers=workers, tile_rows=4, tile_cols=4))
    a, bt = torch.randn(4, 8), torch.randn(8, 8)
    gemm = asyncio.create_task(d.gemm(a, bt, step=0, op=1, name="x"))
    await wire.wait_for(2)
    assert len(wire.on_dropped) == 1
    wire.on_dropped[0]("cleave.tile.a")  # not a result: nothing to do
    wire.on_dropped[0](SUBJECT_RESULTS.format(job="job", epoch=1, worker_id="a"))
    await wire.wait_for(3)
    again = wire.tasks[2:]
    assert [task.attempt for _, task in again] == [1]  # a's tile again, before any deadline
    for w, task in wire.tasks:
        t = d.dealer.deal().ledger.tiles[task.tile]
        await d.on_result(result(task, w, (a @ bt.T)[t.r0 : t.r1, t.c0 : t.c1]), 0)
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)
