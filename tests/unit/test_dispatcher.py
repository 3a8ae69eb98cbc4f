"""The PS's dispatcher without a bus: GEMM fencing (a step redone after a lying worker was caught runs its
GEMMs again under the same (step, op); a late result from the first run must never be assembled into the
second), and results the bus dropped unread (a slow consumer) dealt again at once."""

import asyncio

import pytest
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

    async def settled(self):  # what publish_pieces took is decoded already
        pass

    async def publish_pieces(self, subject, pieces, wait=True):
        frame = b"".join(pieces)
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


# ---- hostile results ---------------------------------------------------------------------------------
async def two_workers(**settings) -> tuple[Wire, Dispatcher, list[float]]:
    wire, clock = Wire(), [0.0]
    d = Dispatcher(wire, "job", 1, PsSettings(window=1, tick_s=1e6, fanout=False, **settings))
    d.clock = lambda: clock[0]
    workers = tuple(PlanWorker(worker_id=w, profile=PROFILE, cache_bytes=1 << 20) for w in ("a", "b"))
    await d.set_plan(Plan(version=1, created_at=0.0, workers=workers, tile_rows=4, tile_cols=4))
    return wire, d, clock


async def one_tile_each() -> tuple[Wire, Dispatcher, list[float], torch.Tensor, torch.Tensor, asyncio.Task,
                                  TileTask, TileTask]:
    """Two workers and a GEMM of two tiles under way, one dealt to each: (wire, dispatcher, clock, a, bt, the
    GEMM's task, a's tile, b's tile)."""
    wire, d, clock = await two_workers()
    a, bt = torch.randn(4, 8), torch.randn(8, 8)
    gemm = asyncio.create_task(d.gemm(a, bt, step=0, op=1, name="x"))
    await wire.wait_for(2)
    (_, t_a), (_, t_b) = sorted(wire.tasks)
    return wire, d, clock, a, bt, gemm, t_a, t_b


def block_of(d: Dispatcher, task: TileTask, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    t = d.dealer.deal().ledger.tiles[task.tile]
    return (a @ bt.T)[t.r0 : t.r1, t.c0 : t.c1]


async def test_a_given_back_attempt_is_still_its_own_workers_alone():
    """After a give-back the attempt no longer runs, but only the worker it was issued to may answer it: b's
    block for a's attempt is refused (`wrong_worker`) even once a's tile is b's too; a's late answer counts."""
    wire, d, clock = await two_workers()
    a, bt = torch.randn(4, 8), torch.randn(8, 8)
    gemm = asyncio.create_task(d.gemm(a, bt, step=0, op=1, name="x"))
    await wire.wait_for(2)
    (wa, t_a), (wb, t_b) = sorted(wire.tasks)
    assert (wa, wb) == ("a", "b")
    await d.on_result(result(t_b, "b", block_of(d, t_b, a, bt)), 0)
    clock[0] = 10.0  # a is silent past its deadline: its tile is given back and dealt to b
    await d._tick()
    await wire.wait_for(3)
    assert wire.tasks[2][0] == "b" and wire.tasks[2][1].tile == t_a.tile and wire.tasks[2][1].attempt == 1
    await d.on_result(result(t_a, "b", torch.full((4, 4), 666.0)), 0)  # b answers a's given-back attempt
    assert wire.rejected == ["wrong_worker"] and not d.dealer.deal().ledger.done - {t_b.tile}
    await d.on_result(result(t_a, "a", block_of(d, t_a, a, bt)), 0)  # a's own answer, late: valid
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)


async def test_a_worker_beaten_by_a_copy_of_its_tile_is_tallied_when_its_block_comes():
    """A worker whose tile an idle worker's copy finished first is tallied when its own block comes after all:
    what the PS reports to the scheduler counts it, so an overclaimer too slow to ever win against the copies
    of its tiles is still corrected."""
    wire, d, clock, a, bt, gemm, t_a, t_b = await one_tile_each()
    await d.on_result(result(t_b, "b", block_of(d, t_b, a, bt)), 0)
    clock[0] = 0.5  # a's tile runs alone past speculate_min_s, within its deadline: copied to idle b
    await d._tick()
    await wire.wait_for(3)
    w, copy = wire.tasks[2]
    assert w == "b" and copy.tile == t_a.tile and copy.attempt == 1
    clock[0] = 0.6
    await d.on_result(result(copy, "b", block_of(d, copy, a, bt)), 0)
    assert "a" not in d.throughput.by
    clock[0] = 0.9
    await d.on_result(result(t_a, "a", block_of(d, t_a, a, bt)), 0)  # its own block, late: what it delivers
    assert d.throughput.by["a"].tiles == 1 and d.throughput.by["a"].busy_s == pytest.approx(0.9)
    await d.on_result(result(t_a, "a", block_of(d, t_a, a, bt)), 0)  # again: counted once
    assert d.throughput.by["a"].tiles == 1
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)


async def test_a_beaten_worker_whose_block_never_comes_is_tallied_when_its_gemm_ends():
    """A worker beaten by a copy of its tile whose own block has not come when the GEMM ends is tallied as
    delivering it then (it took at least that long): an overclaimer whose blocks come after their GEMM, or
    never, is still corrected."""
    wire, d, clock, a, bt, gemm, t_a, t_b = await one_tile_each()
    own = block_of(d, t_a, a, bt)
    await d.on_result(result(t_b, "b", block_of(d, t_b, a, bt)), 0)
    clock[0] = 0.5
    await d._tick()
    await wire.wait_for(3)
    _, copy = wire.tasks[2]
    clock[0] = 0.6
    await d.on_result(result(copy, "b", block_of(d, copy, a, bt)), 0)
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)
    assert d.throughput.by["a"].tiles == 1 and d.throughput.by["a"].busy_s == pytest.approx(0.6)
    await d.on_result(result(t_a, "a", own), 0)  # its block after the GEMM: not counted again
    assert d.throughput.by["a"].tiles == 1


async def test_a_wrong_block_expels_its_worker_and_the_tile_is_redone_elsewhere():
    """Freivalds' check refuses a block that is not the product of its inputs: its worker is excluded (never
    dealt to, its results dropped) and its tile goes to another worker, within the same GEMM."""
    wire, d, clock, a, bt, gemm, t_a, t_b = await one_tile_each()
    await d.on_result(result(t_b, "b", block_of(d, t_b, a, bt)), 0)
    lie = block_of(d, t_a, a, bt).clone()
    lie[1, 2] += 1000.0
    await d.on_result(result(t_a, "a", lie), 0)
    assert wire.rejected == ["wrong_block"] and d.faulty == {"a"} and "a" not in d.dealer.members
    assert any(e.kind == "worker_faulty" and e.worker_id == "a" for e in d.c.recoveries)
    await d._tick()  # the given-back tile goes to whoever asked for work
    await wire.wait_for(3)
    (w, again) = wire.tasks[2]
    assert w == "b" and again.tile == t_a.tile
    await d.on_result(result(t_a, "a", block_of(d, t_a, a, bt)), 0)  # an excluded worker's results: dropped
    assert wire.rejected[-1] == "faulty"
    mallory = result(again, "mallory", block_of(d, again, a, bt))
    await d.on_result(again_block := result(again, "b", block_of(d, again, a, bt)), 0)
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)
    assert d.c.verified == 2 and d.c.verify_cpu_s > 0 and again_block.worker_id == "b"
    await d.on_result(mallory, 0)  # a worker that is not in the plan
    assert wire.rejected[-1] == "not_member"


async def test_what_a_gemms_checks_share_is_computed_as_it_is_dealt_before_any_result():
    """The row norms, random vector and A·y of Freivalds' checks are computed off the loop once the tiles are
    dealt, their CPU counted with the checks'; the first result is then judged with them."""
    wire, d, clock, a, bt, gemm, t_a, t_b = await one_tile_each()
    norms = d.run.norms
    for _ in range(1000):  # (ready in the thread first, its CPU counted once the loop hears back)
        if norms.is_ready and d.c.verify_cpu_s > 0:
            break
        await asyncio.sleep(0.01)
    assert norms.is_ready and d.c.verify_cpu_s > 0 and d.c.verified == 0
    for task, w in ((t_a, "a"), (t_b, "b")):
        await d.on_result(result(task, w, block_of(d, task, a, bt)), 0)
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)
    assert d.run is None and d.c.verified == 2 and norms.x is not None


async def test_every_cross_check_is_judged_even_when_its_verifier_fails():
    """With `verify_fraction`, the verifier's error answer (or its loss) does not leave the check pending:
    the PS judges the first block itself and the GEMM completes."""
    wire, d, clock = await two_workers(verify_fraction=1.0)
    a, bt = torch.randn(4, 4), torch.randn(4, 4)  # one tile: dealt to one worker, checked by the other
    gemm = asyncio.create_task(d.gemm(a, bt, step=0, op=1, name="x"))
    await wire.wait_for(1)
    first_worker, first = wire.tasks[0]
    await d.on_result(result(first, first_worker, a @ bt.T), 0)
    await wire.wait_for(2)
    verifier, check = wire.tasks[1]
    assert verifier != first_worker and check.attempt == 1 and d.run.checks
    error = TileResult(job="job", epoch=1, step=0, op=1, gemm=check.gemm, tile=check.tile, attempt=check.attempt,
                       worker_id=verifier, error="out of memory")
    await d.on_result(error, 0)
    assert torch.equal(await asyncio.wait_for(gemm, 10), a @ bt.T)
    assert d.verifier.alone == 1 and d.verifier.mismatches == 0 and not d.faulty


async def test_a_result_may_be_no_larger_than_the_largest_block_of_the_epoch():
    """What the bus lets through to `on_result`: the largest block any tile of this epoch has, plus an envelope
    (before any GEMM, a result can only be a late or a forged one)."""
    from cleave_ps.fleet.dispatcher import RESULT_ENVELOPE

    wire, d, clock = await two_workers()
    assert d.result_limit() == RESULT_ENVELOPE
    a, bt = torch.randn(4, 8), torch.randn(8, 8)
    gemm = asyncio.create_task(d.gemm(a, bt, step=0, op=1, name="x"))
    await wire.wait_for(2)
    assert d.result_limit() == RESULT_ENVELOPE + 4 * 4 * 4  # two 4x4 float32 blocks
    for w, task in wire.tasks:
        await d.on_result(result(task, w, block_of(d, task, a, bt)), 0)
    await asyncio.wait_for(gemm, 10)
    assert d.result_limit() == RESULT_ENVELOPE + 4 * 4 * 4  # (it stays: a copy's late answer is still fine)


def test_verifiers_are_picked_unpredictably():
    from cleave_ps.fleet.verify import Verifier

    v = Verifier(0.5)
    picks = {v.pick(["a", "b", "c"]) for _ in range(200)}
    assert picks == {"a", "b", "c"}  # not the one with the fewest tiles, nor a seeded sequence
    assert 50 < sum(v.sample() for _ in range(200)) < 150


async def test_a_uniform_grid_is_cut_for_the_plans_workers_not_for_those_answering_now():
    """A GEMM without a planned layout is cut for every worker of the plan, suspect or not: a block of another
    shape may round differently (benchmarks/blas_shapes.py), so one GEMM must get the same tiles whichever of
    the plan's workers happen to be answering."""
    wire = Wire()
    d = Dispatcher(wire, "job", 1, PsSettings(window=1, tick_s=1e6))
    workers = tuple(PlanWorker(worker_id=w, profile=PROFILE, cache_bytes=1 << 20) for w in "abcd")
    await d.set_plan(Plan(version=1, created_at=0.0, workers=workers, tile_rows=64, tile_cols=64))
    for w in "cd":
        d.dealer.members[w].suspect = True
    assert sorted(d.live()) == ["a", "b"]
    gemm = asyncio.create_task(d.gemm(torch.randn(64, 8), torch.randn(64, 8), step=0, op=1, name="x"))
    await wire.wait_for(2)
    assert [(t.rows, t.cols) for t in d.dealer.deal().ledger.tiles] == [(32, 32)] * 4  # not two tiles of 32 x 64
    gemm.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gemm
