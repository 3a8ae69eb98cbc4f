"""What a PS killed in the middle of a checkpoint leaves in JetStream is removed by the next commit: the
chunks of the put it never finished (a real SIGKILL of a process streaming a checkpoint) and a checkpoint it
wrote but never committed; the previous head stays readable throughout, and other jobs' objects stay. And
staged checkpoints: streamed from a copy while training goes on, when memory allows, in line otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import textwrap

import torch
from torch import nn

from cleave import bus as busmod
from cleave.runtime.faults import Faults
from cleave.schemas import STATE_OBJECTS, StepMetrics
from cleave.train.checkpoint import read_checkpoint
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Persister, Progress, snapshot
from tests.integration.test_persist_stream import persister

KILLED = textwrap.dedent("""
    import asyncio, os, signal, sys
    import torch
    from torch import nn
    from cleave import bus as busmod
    from cleave_ps.state.persist import Persister, snapshot

    async def main():
        bus = await busmod.connect(sys.argv[1], "doomed-ps")
        await bus.setup()
        p = Persister(bus, "gc", "{}")
        await p.open()
        await p.claim_epoch()
        model = nn.Linear(4096, 4096)  # 64 MiB: many chunks of the object store
        await p.commit(snapshot(model, None, "gc", 0, p.epoch), ())
        print("committed", flush=True)
        reads = iter(range(10**9))
        kill = lambda: next(reads) == 2 and os.kill(os.getpid(), signal.SIGKILL)  # partway through the stream
        await p.commit(snapshot(model, None, "gc", 1, p.epoch), (), on_read=kill)

    asyncio.run(main())
""")


async def nameless_subjects(bus, store) -> set[str]:  # noqa: ANN001
    info = await bus.js.stream_info(f"OBJ_{STATE_OBJECTS}", subjects_filter=f"$O.{STATE_OBJECTS}.C.>")
    named = {o.nuid for o in await store.list(ignore_deletes=True)}
    return {s for s in (info.state.subjects or {}) if s.rsplit(".", 1)[1] not in named}


async def test_a_kill_mid_write_leaves_nothing_after_the_next_commit(nats_url):
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", KILLED, nats_url], capture_output=True,
                                  text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL and "committed" in run.stdout, run.stderr[-2000:]
    bus, p = await persister(nats_url, "gc")
    other_bus, other = await persister(nats_url, "other")  # another job's checkpoint shares the bucket
    try:
        await other.commit(snapshot(nn.Linear(8, 8), None, "other", 0, other.epoch), ())
        leftover = await nameless_subjects(bus, p.store)
        assert len(leftover) == 1  # the killed put's chunks: no object names them
        model = nn.Linear(4096, 4096)
        head = await p.load(model, None)
        assert head is not None and head.step == 0  # the previous head reads back

        def die_before_head() -> None:  # written completely, never committed
            raise RuntimeError("killed before the head switched")

        with contextlib.suppress(RuntimeError):
            await p.commit(snapshot(model, None, "gc", 7, p.epoch), (), before_head=die_before_head)
        p.orphan_age_s = 0.0  # the killed put is seconds old here; in a PS it waits DEFAULT_ORPHAN_AGE_S
        with torch.no_grad():
            model.weight += 1.0
        new = await p.commit(snapshot(model, None, "gc", 1, p.epoch), ())
        assert set(p.collected.purged) == leftover
        never = f"gc/step-00000007-e{p.epoch}"
        assert set(p.collected.deleted) == {never, f"{never}.data"}
        names = {o.name for o in await p.store.list(ignore_deletes=True)}
        mine = {n for n in names if n.startswith("gc/")}
        assert mine == {head.object, f"{head.object}.data", new.object, f"{new.object}.data"}
        assert {"other/step-00000000-e1", "other/step-00000000-e1.data"} <= names
        assert await nameless_subjects(bus, p.store) == set()
        again = nn.Linear(4096, 4096)
        q = Persister(bus, "gc", "{}")
        await q.open()
        assert (await q.load(again, None)).step == 1 and torch.equal(again.weight, model.weight)
    finally:
        await other_bus.close()
        await bus.close()


async def run_steps(nats_url: str, tmp_path, job_id: str, **settings: object) -> tuple[Progress, list[dict], dict]:  # noqa: ANN001
    """Three steps of the tiny preset committed after each by a real Progress; the checkpoint of step 1 (its
    commit streamed while step 2 changed the live tensors) holds the state after step 1."""
    job = JobConfig(job_id=job_id, preset="tiny", steps=3, batch_size=2, seq_len=16)
    s = PsSettings(nats_url=nats_url, metrics_out=tmp_path / f"{job.job_id}.jsonl", persist_every=1, **settings)
    bus = await busmod.connect(nats_url, "test-ps")
    try:
        await bus.setup()
        progress, t, first = Progress(bus, job, s, Faults()), Trainer(job), {}
        await progress.open()
        in_background = []
        for step in range(job.steps):
            loss = t.step(step)
            await progress.done(StepMetrics(job=job.job_id, step=step, loss=loss, step_time_s=1.0, workers=0), t.model,
                                t.opt)
            in_background.append(progress.inflight is not None and not progress.inflight.done())
            if step == 1:
                first = {k: v.clone() for k, v in t.model.state_dict().items()}
        await progress.finish(0)
        heads = await progress.persister._heads()
        back = Trainer(job)
        await read_checkpoint(bus.js, progress.persister.store, next(h for h in heads if h.step == 1), back.model, back.opt)
        assert all(torch.equal(v, first[k]) for k, v in back.model.state_dict().items())
    finally:
        await bus.close()
    lines = [json.loads(x) for x in s.metrics_out.read_text().splitlines()]
    return progress, lines, {"in_background": in_background, "heads": sorted(h.step for h in heads)}


async def test_staged_checkpoints_stream_while_training_goes_on(nats_url, tmp_path):
    progress, lines, seen = await run_steps(nats_url, tmp_path, "staged", checkpoint_staging="auto")
    assert seen["in_background"] == [True, True, False]  # the last step's commit is waited for
    assert seen["heads"] == [0, 1, 2] and [m["step"] for m in lines] == [0, 1, 2]  # each line once, in order
    progress, lines, seen = await run_steps(nats_url, tmp_path, "in-line", checkpoint_staging="auto",
                                             memory_bytes=1000)
    assert seen["in_background"] == [False, False, False] and progress._told  # no memory: said, and in line
    assert seen["heads"] == [0, 1, 2] and [m["step"] for m in lines] == [0, 1, 2]
