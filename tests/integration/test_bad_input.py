"""A hostile peer floods the PS with bad results during real training: none reaches the model. (Mallory is not a
member of the plan, so its well-formed results are refused as such; tests/integration/test_hostile.py attacks
from a worker that is one.)"""

from __future__ import annotations

import asyncio
import struct

import torch

from cleave import bus as busmod
from cleave import codec
from cleave.schemas import LinkCheckAck, TileResult, TileTask
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import InProcessPS, assert_same, start_fleet


def forgeries(task: TileTask, rows: int, cols: int) -> list[bytes]:
    def result(**kw) -> bytes:
        base = dict(job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
                    attempt=task.attempt, worker_id="mallory", out=codec.tensor_to_data(torch.zeros(rows, cols)))
        return codec.encode(TileResult(**{**base, **kw}), compress=False)

    nan = torch.zeros(rows, cols)
    nan[0, 0] = float("nan")
    huge_chunk = codec.MAGIC + bytes([codec.VERSION, codec.FLAG_CHUNK]) + struct.pack("<16sIIQ", b"x" * 16, 0, 9, 1 << 40)
    return [
        b"\x00garbage",
        huge_chunk,  # declares a terabyte
        codec.MAGIC + bytes([codec.VERSION, 0]) + b"\x93\x01\x02\x03",  # valid msgpack, wrong schema
        result(out=codec.tensor_to_data(torch.zeros(rows + 1, cols))),  # wrong shape
        result(out=codec.tensor_to_data(torch.zeros(rows, cols, dtype=torch.float64))),  # wrong dtype
        result(out=codec.tensor_to_data(nan)),  # NaN
        result(step=task.step + 7),  # wrong step
        result(job="other"),  # wrong job
        result(tile=10_000),  # a tile that does not exist
        result(attempt=task.attempt + 5),  # an attempt never issued
        result(),  # claims someone else's tile
        codec.encode(TileResult(job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm,
                                tile=task.tile, attempt=task.attempt, worker_id="mallory",
                                out=codec.tensor_to_data(torch.zeros(rows, cols)))),  # zstd: results never are
    ]


async def test_flood_of_bad_results_never_reaches_the_model(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=3)
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    attacker = await busmod.connect(nats_url, "mallory")
    sent = 0

    async def on_task(task: TileTask, nbytes: int) -> None:
        nonlocal sent
        a, b = task.a.tensor, task.b.tensor
        if a is None or b is None:
            return
        own = task.reply.rsplit(".", 1)[0] + ".mallory"  # results go on per-worker subjects: its own ...
        for frame in forgeries(task, a.shape[0], b.shape[0]):
            await attacker.nc.publish(own, frame)
            sent += 1
        await attacker.nc.publish(task.reply, forgeries(task, a.shape[0], b.shape[0])[-2])  # ... or the victim's
        sent += 1

    sub = await attacker.subscribe("cleave.tile.*", TileTask, on_task)
    try:
        async with InProcessPS(nats_url) as ps:
            await ps.wait_workers(2)
            ref, dist = Trainer(job), Trainer(job, ps.backend)
            want = [ref.step(s) for s in range(job.steps)]
            got = [await ps.step(lambda s=s: dist.step(s), s) for s in range(job.steps)]
            assert_same(got, want)
            reasons = ps.bus.rejected
            assert sent > 0
            assert {"bad_magic", "too_large", "bad_schema", "wrong_job", "not_member", "zstd_refused",
                    "wrong_sender"} <= set(reasons), reasons
            assert ps.dispatcher.c.rejected > 0
    finally:
        await sub.unsubscribe()
        await attacker.close()
        fleet.stop()


async def test_a_flood_past_the_pending_limit_is_dropped_unread_not_held(nats_url):
    """A peer that floods a subscription while its handler is busy (the PS's results during a step's local
    compute): the subscription holds at most its `pending_bytes` (the PS's: CLEAVE_PS_MAX_PENDING_BYTES)
    unread, drops the rest and says so (`Bus.on_dropped`, which the dispatcher hears), so a flood costs
    messages, never the receiver's memory."""
    ps, mallory = await busmod.connect(nats_url, "ps"), await busmod.connect(nats_url, "mallory")
    limit, block, sent = 8 << 20, b"\0" * (1 << 20), 64
    busy, last, handled, dropped = asyncio.Event(), asyncio.Event(), [], []
    ps.on_dropped.append(dropped.append)

    async def handler(msg: LinkCheckAck, nbytes: int) -> None:
        handled.append(msg.worker_id)
        if msg.worker_id == "last":
            last.set()
        await busy.wait()

    sub = await ps.subscribe("flood.mallory", LinkCheckAck, handler, pending_bytes=limit)
    try:
        await ps.nc.flush()
        await mallory.nc.publish("flood.mallory", codec.encode(LinkCheckAck(worker_id="first")))
        for _ in range(sent):
            await mallory.nc.publish("flood.mallory", block)
        await mallory.nc.flush()
        await ps.nc.flush()  # (the server has delivered everything published before this round trip)
        assert handled == ["first"]
        assert sub.pending_bytes <= limit and len(dropped) >= sent - limit // len(block), (sub.pending_bytes, len(dropped))
        assert set(dropped) == {"flood.mallory"}
        busy.set()
        await mallory.nc.publish("flood.mallory", codec.encode(LinkCheckAck(worker_id="last")))
        await asyncio.wait_for(last.wait(), 10)  # read in order: everything held before it has been read
        held = sent - len(dropped)  # ... and refused as the garbage it is
        assert ps.rejected.get("bad_magic", 0) == held and handled == ["first", "last"]
    finally:
        await sub.unsubscribe()
        await mallory.close()
        await ps.close()
