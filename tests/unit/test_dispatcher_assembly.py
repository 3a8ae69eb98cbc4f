"""A GEMM's product is returned only once every block is in it: the last block of a large result is copied
into the product in a thread after the ledger marks its tile done, and the dispatcher's periodic tick must
not take "every tile done" for "every block assembled" (a product returned before its last block was copied
in fed uninitialised memory into training: a NaN loss on gpt2-medium)."""

import asyncio

import torch

from cleave.schemas import Plan, PlanWorker
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.settings import PsSettings
from tests.unit.test_dispatcher import PROFILE, Wire, result


async def test_a_gemm_returns_only_once_its_last_block_is_copied_in():
    wire = Wire()
    d = Dispatcher(wire, "job", 1, PsSettings(window=1, tick_s=0.005))
    workers = tuple(PlanWorker(worker_id=w, profile=PROFILE, cache_bytes=1 << 20) for w in ("a", "b"))
    await d.set_plan(Plan(version=1, created_at=0.0, workers=workers, tile_rows=4, tile_cols=4))
    a, bt = torch.randn(4, 8), torch.randn(8, 8)  # two 4x4 tiles
    truth = a @ bt.T
    gate, copying, answering, calls = asyncio.Event(), asyncio.Event(), asyncio.Event(), []
    real = Dispatcher._off_loop

    async def slow(nbytes, fn):  # noqa: ANN001, ANN202 - the last block's copy waits for the gate
        if not answering.is_set():  # encoding the tiles
            return await real(nbytes, fn)
        calls.append(nbytes)
        if len(calls) == 4:  # (per result: the finiteness check, then the copy)
            copying.set()
            await gate.wait()
        return await real(nbytes, fn)

    d._off_loop = slow
    gemm = asyncio.create_task(d.gemm(a, bt, step=0, op=1, name="x"))
    await wire.wait_for(2)
    answering.set()
    blocks = {task.tile: d.dealer.deal().ledger.tiles[task.tile] for _, task in wire.tasks}
    answers = [asyncio.create_task(d.on_result(result(task, w, truth[blocks[task.tile].r0:blocks[task.tile].r1,
                                                                     blocks[task.tile].c0:blocks[task.tile].c1]), 0))
               for w, task in wire.tasks]
    await asyncio.wait_for(copying.wait(), 10)
    assert d.dealer.is_complete(d.seq)  # every tile done in the ledger, the last block not yet in the product
    finished, _ = await asyncio.wait({gemm}, timeout=0.2)  # forty ticks
    assert not finished, "the GEMM returned before its last block was copied in"
    gate.set()
    out = await asyncio.wait_for(gemm, 10)
    await asyncio.gather(*answers)
    assert torch.equal(out, truth)
