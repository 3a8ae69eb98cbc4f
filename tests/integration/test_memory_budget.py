"""A worker refuses a tile over its memory budget with an error result (never an out-of-memory), and the PS
gets the tile done by another worker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from cleave import bus as busmod
from cleave import codec
from cleave.api.fleet import LocalFleet
from cleave.gemm import tiles
from cleave.runtime.memory import resident
from cleave.schemas import SUBJECT_TILES, BlockRef, TileResult, TileTask
from cleave_worker.core import tile_bytes
from tests.integration.fleet import InProcessPS

SMALL = 64 * 1024 * 1024  # the refusing worker's budget (CLEAVE_WORKER_MEMORY_BYTES)
SMALL_ENV = {"CLEAVE_WORKER_MEMORY_BYTES": str(SMALL), "CLEAVE_WORKER_CACHE_BYTES": str(32 * 1024 * 1024)}
M, N, K = 6144, 4096, 768  # dealt as two 3072 x 4096 tiles: 48 MiB out + 21 MiB in = 69 MiB > 64 MiB
READY_TIMEOUT_S = 60.0


def task(worker_tag: str, tile: int, a: torch.Tensor, bt: torch.Tensor, reply: str) -> TileTask:
    return TileTask(job="budget", epoch=1, step=0, op=1, tile=tile, a=BlockRef(id=f"{worker_tag}a{tile}",
                    tensor=codec.tensor_to_data(a)), b=BlockRef(id=f"{worker_tag}b{tile}",
                    tensor=codec.tensor_to_data(bt)), reply=reply)


async def test_a_tile_over_the_budget_gets_an_error_result_and_the_worker_goes_on(tmp_path, nats_url):
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url)
    fleet.start()  # the scheduler: a worker joins once it has measured its links against it
    name = fleet.add_worker(env=SMALL_ENV)
    worker_id = f"{tmp_path.name}-w1"
    bus = await busmod.connect(nats_url, "test-budget")
    results: asyncio.Queue[TileResult] = asyncio.Queue()

    async def on_result(msg: TileResult, nbytes: int) -> None:
        await results.put(msg)

    sub = await bus.subscribe("test.budget.results", TileResult, on_result)
    try:
        torch.manual_seed(0)
        big_a, big_bt = torch.randn(3072, K), torch.randn(N, K)
        assert tile_bytes(big_a, big_bt) > SMALL
        fits_a, fits_bt = torch.randn(256, K), torch.randn(512, K)
        deadline = time.monotonic() + READY_TIMEOUT_S
        got: dict[int, TileResult] = {}
        # the worker subscribes once it has measured itself: send until it has answered both (nats-server may drop
        # the first messages of a publisher connected before the subscription: see test_publish_pieces)
        while not {0, 1} <= got.keys():
            assert time.monotonic() < deadline, "the worker never answered"
            await bus.publish(SUBJECT_TILES.format(worker_id=worker_id), task("x", 0, big_a, big_bt, sub.subject))
            await bus.publish(SUBJECT_TILES.format(worker_id=worker_id), task("x", 1, fits_a, fits_bt, sub.subject))
            for _ in range(2):
                try:
                    msg = await asyncio.wait_for(results.get(), 2.0)
                except TimeoutError:
                    break
                got[msg.tile] = msg
        refused, done = got[0], got[1]
        assert refused.out is None and f"over this worker's budget of {SMALL}" in refused.error, refused.error
        assert f"needs {tile_bytes(big_a, big_bt)} bytes" in refused.error
        assert not done.error and torch.equal(codec.data_to_tensor(done.out), tiles.compute(fits_a, fits_bt))
        assert fleet.stack.procs[name].popen.poll() is None  # refused, not killed by an out-of-memory
    finally:
        await sub.unsubscribe()
        await bus.close()
        fleet.stop()


async def wait_plan(ps: InProcessPS, workers: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while ps.dispatcher.plan is None or len(ps.dispatcher.workers) < workers:
        assert time.monotonic() < deadline, "no plan with both workers"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_refused_tile_is_computed_by_another_worker(tmp_path, nats_url):
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url,
                       scheduler_env={"CLEAVE_SCHEDULER_TILE_ROWS": "3072", "CLEAVE_SCHEDULER_TILE_COLS": "4096"})
    try:
        fleet.start()
        fleet.add_worker(env=SMALL_ENV)
        fleet.add_worker()  # the default budget, 512 MiB
        async with InProcessPS(nats_url, speculate_factor=0, tile_timeout_s=30) as ps:
            await wait_plan(ps, 2)
            torch.manual_seed(0)
            a, bt = torch.randn(M, K), torch.randn(N, K)
            ps.backend.begin(0)
            gemm = asyncio.ensure_future(asyncio.to_thread(ps.backend.gemm, a, bt, "unplanned"))
            done, _ = await asyncio.wait({gemm}, timeout=30)
            if not done:
                ps.dispatcher.stopping = True  # ends the GEMM (StepAborted) so that the test can stop
                with contextlib.suppress(Exception):
                    await gemm
                raise AssertionError(f"the GEMM never finished: {ps.bus.rejected}")
            out = gemm.result()
            assert torch.equal(out, tiles.compute(a, bt))  # every tile, exactly, by the worker with room
            assert ps.bus.rejected.get("worker_error", 0) >= 1, ps.bus.rejected
    finally:
        fleet.stop()


async def test_a_worker_holds_about_one_tile_of_memory(tmp_path, nats_url):
    """A worker's peak memory grows by at most twice a tile's working set (its blocks arrive, are decoded and
    multiplied, and its result is sent) however many such tiles it computes one after the other: nothing of a
    tile it has answered is kept (the cache aside, 8 MiB here). It grows by 1.1 times; a sent result that stayed
    referenced until the garbage collector's next pass, and a message's bytes kept while it was computed, took it
    to 3.2 times."""
    cache = 8 * 1024 * 1024
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url)
    fleet.start()
    name = fleet.add_worker(env={"CLEAVE_WORKER_CACHE_BYTES": str(cache)})
    worker_id = f"{tmp_path.name}-w1"
    bus = await busmod.connect(nats_url, "test-memory")
    answers = await busmod.connect(nats_url, "test-memory-answers")  # results read at the socket's pace
    done: asyncio.Queue[int] = asyncio.Queue()
    chunks: dict[bytes, int] = {}

    async def on_result(m) -> None:  # noqa: ANN001 - nats-py's Msg: counted, not joined
        if m.data[3] & codec.FLAG_CHUNK:
            msg_id, _, count, _ = codec._CHUNK.unpack_from(m.data, 4)
            chunks[msg_id] = chunks.get(msg_id, 0) + 1
            if chunks[msg_id] == count:
                await done.put(count)
        else:
            result = codec.decode(m.data, TileResult)
            assert not result.error, result.error
            await done.put(1)

    sub = await answers.nc.subscribe("test.memory.results", cb=on_result, pending_bytes_limit=-1)
    subject = SUBJECT_TILES.format(worker_id=worker_id)
    pid = fleet.stack.procs[name].popen.pid
    try:
        torch.manual_seed(0)
        a, bt = torch.randn(4096, 2048), torch.randn(4096, 2048)  # 67 MB in, 67 MB out
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # until the worker has measured itself and subscribed
            assert time.monotonic() < deadline, "the worker never answered"
            await bus.publish(subject, task("warm", 0, a[:8], bt[:8], "test.memory.results"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.get(), 2.0)
                break
        idle, _ = resident(pid)
        assert idle > 0, "the worker is gone"
        for tile in range(1, 4):
            await bus.publish(subject, task("big", tile, a, bt, "test.memory.results"), compress=False)
            assert await asyncio.wait_for(done.get(), 60.0) > 1
        grown = resident(pid)[0] - idle
        assert grown <= 2 * tile_bytes(a, bt), f"peak grew by {grown / 1e6:.0f} MB for tiles of {tile_bytes(a, bt) / 1e6:.0f} MB"
    finally:
        await sub.unsubscribe()
        await answers.close()
        await bus.close()
        fleet.stop()
