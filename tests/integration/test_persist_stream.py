"""Streamed checkpoints against a real nats-server: larger than any one message, and a damaged one falls back."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from cleave import bus as busmod
from cleave.errors import JobChanged
from cleave.runtime.faults import Faults
from cleave.schemas import MAX_MESSAGE_BYTES, STATE_OBJECTS, StepMetrics
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Persister, Progress, snapshot

BIG_ELEMENTS = 36 * 1024 * 1024  # two of these in fp32: 288 MiB, over the codec's 256 MiB message limit


class Big(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((BIG_ELEMENTS,), fill))
        self.b = nn.Parameter(torch.arange(BIG_ELEMENTS, dtype=torch.float32))


async def persister(url: str, job: str, config: str = "{}") -> tuple[busmod.Bus, Persister]:
    bus = await busmod.connect(url, "test")
    await bus.setup()
    p = Persister(bus, job, config)
    await p.open()
    await p.claim_epoch()
    return bus, p


async def test_a_checkpoint_larger_than_one_message_round_trips_exactly(nats_url):
    src = Big(0.5)
    with torch.no_grad():
        src.a[::4096] = torch.randn(BIG_ELEMENTS // 4096)
    bus, p = await persister(nats_url, "big")
    try:
        head = await p.commit(snapshot(src, None, "big", 0, p.epoch), ())
        assert head.size == 2 * BIG_ELEMENTS * 4 > MAX_MESSAGE_BYTES
        dst = Big(0.0)
        got = await reload(bus, "big", "{}", dst, None)
        assert got is not None and got.step == 0
        assert torch.equal(dst.a, src.a) and torch.equal(dst.b, src.b)
    finally:
        await bus.close()


async def reload(bus: busmod.Bus, job: str, config: str, model: nn.Module, opt) -> object:  # noqa: ANN001
    """What a restarted PS loads: a fresh Persister on the same bus."""
    p = Persister(bus, job, config)
    await p.open()
    return await p.load(model, opt)


async def test_a_damaged_checkpoint_falls_back_to_the_previous_one(nats_url):
    job = JobConfig(job_id="dmg", preset="tiny", steps=3, batch_size=2, seq_len=16)
    t = Trainer(job)
    bus, p = await persister(nats_url, job.job_id, job.model_dump_json())
    try:
        t.step(0)
        await p.commit(snapshot(t.model, t.opt, job.job_id, 0, p.epoch), ())
        step0 = {k: v.clone() for k, v in t.model.state_dict().items()}
        t.step(1)
        head = await p.commit(snapshot(t.model, t.opt, job.job_id, 1, p.epoch), ())
        for damage, why in ((_flip_one_byte, "does not match its sha256"), (_truncate, "bytes")):
            await damage(p.store, f"{head.object}.data")
            fresh = Trainer(job)
            q = Persister(bus, job.job_id, job.model_dump_json())
            await q.open()
            got = await q.load(fresh.model, fresh.opt)
            assert got is not None and got.step == 0  # the step-1 checkpoint was refused
            assert all(torch.equal(v, step0[k]) for k, v in fresh.model.state_dict().items())
            [(step, reason)] = q.rejected  # and logged as checkpoint_rejected with this reason
            assert step == 1 and reason.endswith(why), reason
    finally:
        await bus.close()


async def test_a_job_resumed_from_an_older_checkpoint_sets_its_later_lines_aside(nats_url, tmp_path):
    """The metrics file kept the lines of the steps whose checkpoint did not read back, and the steps run again
    were not written (each step is written once): it described a model thrown away. It is set aside whole and
    begun anew with the lines up to the checkpoint resumed."""
    job = JobConfig(job_id="older", preset="tiny", steps=4, batch_size=2, seq_len=16)
    t, out = Trainer(job), tmp_path / "m.jsonl"
    s = PsSettings(metrics_out=out, persist_every=1)
    first = Progress(await busmod.connect(nats_url, "ps-1"), job, s, Faults(""))
    try:
        await first.bus.setup()
        await first.open()
        for step in range(2):
            await first.commit(snapshot(t.model, t.opt, job.job_id, step, first.epoch),
                               (StepMetrics(job=job.job_id, step=step, loss=t.step(step), step_time_s=0.1, workers=1),))
        await _truncate(first.persister.store, f"{(await first.persister._heads())[0].object}.data")
    finally:
        await first.bus.close()
    before = out.read_text().splitlines()
    again = Progress(await busmod.connect(nats_url, "ps-2"), job, s, Faults(""))
    try:
        await again.open()
        fresh = Trainer(job)
        assert await again.resume(fresh.model, fresh.opt) == 1  # from step 0's checkpoint: step 1 runs again
    finally:
        await again.bus.close()
    assert out.read_text().splitlines() == before[:1]
    (kept,) = tmp_path.glob("m.before-older-*.jsonl")
    assert kept.read_text().splitlines() == before


async def _flip_one_byte(store, name: str) -> None:  # noqa: ANN001
    data = bytearray((await store.get(name)).data)
    data[len(data) // 2] ^= 0x10
    await store.put(name, bytes(data))


async def _truncate(store, name: str) -> None:  # noqa: ANN001
    data = (await store.get(name)).data
    await store.put(name, data[: len(data) - 100])


async def test_every_kept_head_is_read_even_where_a_watch_would_end_early(nats_url):
    """nats-py reads a key's history with a watch that can end before its first entry on a busy machine (its
    consumer has delivered every entry before the client counted one: NoKeysError) or after some of them. The
    PS reads its heads one message at a time instead: a restarted PS resumes from its head, and every older
    head the bucket keeps is there as a fallback (seen under load: only the newest head came back)."""
    from nats.js.errors import NoKeysError

    job = JobConfig(job_id="short", preset="tiny", steps=3, batch_size=2, seq_len=16)
    t = Trainer(job)
    bus, p = await persister(nats_url, job.job_id, job.model_dump_json())
    other_bus, other = await persister(nats_url, "short-other")  # another job's heads interleave in the stream
    try:
        for step in range(3):
            t.step(step)
            await p.commit(snapshot(t.model, t.opt, job.job_id, step, p.epoch), ())
            await other.commit(snapshot(nn.Linear(2, 2), None, "short-other", step, other.epoch), ())
        want = {k: v.clone() for k, v in t.model.state_dict().items()}

        async def none(key: str) -> list:
            raise NoKeysError

        q = Persister(bus, job.job_id, job.model_dump_json())
        await q.open()
        q.kv.history = none
        assert [h.step for h in await q._heads()] == [2, 1, 0]
        fresh = Trainer(job)
        got = await q.load(fresh.model, fresh.opt)
        assert got is not None and got.step == 2
        assert all(torch.equal(v, want[k]) for k, v in fresh.model.state_dict().items())
    finally:
        await other_bus.close()
        await bus.close()


@pytest.mark.parametrize(("from_end", "lost"), [(100_000, 12), (2_200_000, 10)])  # its 5 messages are 9-13
async def test_a_checkpoint_the_server_cannot_deliver_is_given_up_at_once(nats_server, monkeypatch, from_end, lost):
    """A damaged block of the server's own store (a flipped bit on its disk): the server never delivers that
    chunk, and a read waited an hour (the whole transfer's timeout) without a word, then TRANSFER_STALL_S
    (60 s) for each damaged checkpoint. A read that receives nothing for STALL_CHECK_S asks the server for the
    chunks not yet checked, and one it has lost gives the checkpoint up; the one before it is loaded instead.
    (The server passes over a message it cannot read and delivers the rest: the read then waits.)"""
    from cleave.train import checkpoint

    monkeypatch.setattr(checkpoint, "STALL_CHECK_S", 1.0)
    first, second = nn.Linear(1024, 1024), nn.Linear(1024, 1024)  # 4 MiB each: several messages of the store
    bus, p = await persister(nats_server.url, "disk")
    try:
        await p.commit(snapshot(first, None, "disk", 0, p.epoch), ())
        await p.commit(snapshot(second, None, "disk", 1, p.epoch), ())
    finally:
        await bus.close()
    nats_server.stop()
    blocks = nats_server.store.glob(f"jetstream/*/streams/OBJ_{STATE_OBJECTS}/msgs/*.blk")
    block = max(blocks, key=lambda b: b.stat().st_size)  # (8 MiB blocks: the first holds most of both)
    data = bytearray(block.read_bytes())
    data[len(data) - from_end] ^= 1  # in the last checkpoint's data, before its manifest
    block.write_bytes(bytes(data))
    nats_server.start()
    bus = await busmod.connect(nats_server.url, "test")
    try:
        q = Persister(bus, "disk", "{}")
        await q.open()
        got, t0 = nn.Linear(1024, 1024), time.monotonic()
        head = await q.load(got, None)
        assert head is not None and head.step == 0 and torch.equal(got.weight, first.weight)
        [(step, reason)] = q.rejected
        assert step == 1 and f"the server lost one of its messages (stream sequence {lost}," in reason, reason
        assert time.monotonic() - t0 < 30  # (TRANSFER_STALL_S is 60)
    finally:
        await bus.close()


async def test_a_changed_round_method_job_is_refused_in_rounds(nats_url):
    """The refusal of a changed diloco/fedavg job counted its rounds as steps ('up to step 2')."""
    job = JobConfig(job_id="rounds-changed", method="diloco", preset="tiny", steps=3, local_steps=2)
    t = Trainer(job)
    bus, p = await persister(nats_url, job.job_id, job.model_dump_json())
    try:
        await p.commit(snapshot(t.model, None, job.job_id, 2, p.epoch), ())
        changed = job.model_copy(update={"seed": 7}).model_dump_json()
        with pytest.raises(JobChanged, match=r"already has state \(up to round 2\) of another model, data order or privacy noise: seed: 0 -> 7"):
            await reload(bus, job.job_id, changed, Trainer(job).model, None)
    finally:
        await bus.close()
