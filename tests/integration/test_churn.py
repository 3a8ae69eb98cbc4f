"""Churn and crashes with deterministic fault injection: every run still trains the reference's model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import nats
import pytest

from cleave import bus as busmod
from cleave.errors import Fenced
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.state.persist import Persister, snapshot
from tests.integration.fleet import InProcessPS, assert_same, start_fleet


def reference(job: JobConfig) -> list[float]:
    trainer = Trainer(job)
    return [trainer.step(s) for s in range(job.steps)]


def test_ps_killed_at_every_dangerous_point_resumes_exactly(tmp_path):
    """SIGKILL the PS mid-step, mid-way through streaming a checkpoint, between persisting and the head
    switch, and between commit and report."""
    job = JobConfig(job_id="crashy", preset="tiny", steps=10)
    out = tmp_path / "m.jsonl"
    env = {**os.environ, "CLEAVE_PS_FAIL_AT": "in_step:2,before_commit:4,mid_commit:5,after_commit:6",
           "CLEAVE_PS_FAULT_DIR": str(tmp_path / "faults"), "CLEAVE_PS_PERSIST_EVERY": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--steps", "10", "--workers", "2",
         "--job-id", "crashy", "--metrics-out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list((tmp_path / "faults").iterdir())) == 4  # all four faults fired
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(10))  # every step exactly once
    assert_same([m["loss"] for m in lines], reference(job))
    assert any(m["resumed"] for m in lines)
    stack = json.loads((tmp_path / "run" / "stack.json").read_text())
    assert next(p for p in stack["processes"] if p["role"] == "ps")["restarts"] == 4


async def test_worker_killed_by_fault_mid_gemm(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=5)
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    fleet.stack.service("worker-x", "worker", ["--worker-id", "victim"],
                        env={"CLEAVE_WORKER_FAIL_AT": "tile:3", "CLEAVE_WORKER_FAULT_DIR": str(tmp_path / "faults")},
                        restart=False)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            got = [await ps.step(lambda s=s: dist.step(s), s) for s in range(job.steps)]
            assert_same(got, reference(job))
            assert fleet.stack.procs["worker-x"].popen.poll() == -signal.SIGKILL
            rec = ps.dispatcher.c.recoveries
            assert rec and rec[0].worker_id == "victim" and rec[0].step == 3
            assert rec[0].detect_s is not None and rec[0].complete_s >= rec[0].redispatch_s >= 0
    finally:
        fleet.stop()


async def test_frozen_worker_wakes_with_stale_results(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=6)
    fleet = start_fleet(tmp_path, nats_url, workers=3)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.4, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            frozen = fleet.stack.procs["worker-1"].popen
            got = []
            for s in range(job.steps):
                if s == 2:
                    os.kill(frozen.pid, signal.SIGSTOP)
                if s == 4:
                    os.kill(frozen.pid, signal.SIGCONT)  # it sends results for GEMMs long finished
                got.append(await ps.step(lambda s=s: dist.step(s), s))
            assert_same(got, reference(job))
            assert ps.dispatcher.c.resent > 0
    finally:
        fleet.stop()


async def test_all_workers_gone_then_one_returns(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=4)
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.4, speculate_factor=0) as ps:
            await ps.wait_workers(2)
            dist = Trainer(job, ps.backend)
            got = [await ps.step(lambda: dist.step(0), 0)]
            for name in ("worker-1", "worker-2"):
                fleet.stack.kill(name, restart=False)
            step = asyncio.ensure_future(ps.step(lambda: dist.step(1), 1))
            await asyncio.sleep(1.5)  # fault injection timing, not synchronisation: the step must still wait
            assert not step.done()
            fleet.add_worker()
            got.append(await asyncio.wait_for(step, 60))
            got += [await ps.step(lambda s=s: dist.step(s), s) for s in range(2, job.steps)]
            assert_same(got, reference(job))
    finally:
        fleet.stop()


async def test_nats_and_scheduler_restart_mid_job(tmp_path, nats_server):
    job = JobConfig(preset="tiny", steps=6)
    fleet = start_fleet(tmp_path, nats_server.url, workers=2)
    try:
        async with InProcessPS(nats_server.url, tile_timeout_s=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(2)
            dist = Trainer(job, ps.backend)
            got = []
            for s in range(job.steps):
                step = asyncio.ensure_future(ps.step(lambda s=s: dist.step(s), s))
                if s == 2:
                    await asyncio.to_thread(nats_server.restart)
                if s == 4:
                    fleet.stack.kill("scheduler")
                    fleet.stack.supervise()  # brought back, as compose's restart policy would
                got.append(await asyncio.wait_for(step, 120))
            assert_same(got, reference(job))
            assert fleet.stack.procs["scheduler"].restarts == 1
    finally:
        fleet.stop()


async def test_an_older_ps_is_fenced(tmp_path, nats_url):
    job = JobConfig(job_id="fence", preset="tiny", steps=2)
    trainer = Trainer(job)
    trainer.step(0)
    old_bus, new_bus = await busmod.connect(nats_url, "old"), await busmod.connect(nats_url, "new")
    try:
        old, new = Persister(old_bus, job.job_id, job.model_dump_json()), Persister(new_bus, job.job_id, job.model_dump_json())
        await old_bus.setup()
        await old.open()
        await new.open()
        assert await old.claim_epoch() == 1
        assert await new.claim_epoch() == 2
        with pytest.raises(Fenced):
            await old.commit(snapshot(trainer.model, trainer.opt, job.job_id, 0, old.epoch), ())
        await new.commit(snapshot(trainer.model, trainer.opt, job.job_id, 0, new.epoch), ())
        head = await _reload(new_bus, job, Trainer(job))
        assert head.epoch == 2 and head.step == 0
    finally:
        await old_bus.close()
        await new_bus.close()


async def test_a_commit_whose_answer_is_lost_in_an_election_lands_once(tmp_path, nats_url):
    """During a cluster election a KV request may time out after it was applied. The commit tries again
    (`Bus.patiently`): its own head found in place is success, not a fence; another PS's head still fences."""
    job = JobConfig(job_id="lost-answer", preset="tiny", steps=2)
    trainer = Trainer(job)
    bus, other_bus = await busmod.connect(nats_url, "ps"), await busmod.connect(nats_url, "other")
    try:
        await bus.setup()
        p = Persister(bus, job.job_id, job.model_dump_json())
        await p.open()
        await p.claim_epoch()
        real, lost, waits = p.kv.update, [], [p.kv.get]

        async def update_then_time_out(key, value, last=None):  # applied, but the answer never arrives
            rev = await real(key, value, last=last)
            if not lost:
                lost.append(rev)
                raise TimeoutError("the stream is electing a leader")
            return rev

        async def get_once_slow(key):
            if len(waits) == 1:
                waits.append(None)
                raise nats.errors.NoRespondersError()
            return await waits[0](key)

        p.kv.update, p.kv.get = update_then_time_out, get_once_slow
        await p.commit(snapshot(trainer.model, trainer.opt, job.job_id, 0, p.epoch), ())  # creates the head
        head = await p.commit(snapshot(trainer.model, trainer.opt, job.job_id, 1, p.epoch), ())
        assert lost and p.revision == lost[0] and head.step == 1 and bus.retries >= 2
        assert (await _reload(other_bus, job, Trainer(job))).step == 1
        other = Persister(other_bus, job.job_id, job.model_dump_json())
        await other.open()
        await other.claim_epoch()  # a newer PS: it claims the head with its epoch
        await other.commit(snapshot(trainer.model, trainer.opt, job.job_id, 2, other.epoch), ())
        with pytest.raises(Fenced):
            await p.commit(snapshot(trainer.model, trainer.opt, job.job_id, 3, p.epoch), ())
    finally:
        await bus.close()
        await other_bus.close()


async def _reload(bus, job, trainer):
    p = Persister(bus, job.job_id, job.model_dump_json())
    await p.open()
    return await p.load(trainer.model, trainer.opt)


async def test_a_straggler_is_overtaken_by_a_speculative_copy(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=4)
    fleet = start_fleet(tmp_path, nats_url, workers=3)
    try:
        # the deadline is far away: speculative copies finish the frozen worker's tiles long before it
        async with InProcessPS(nats_url, tile_timeout_s=60, speculate_factor=3, speculate_min_s=0.1) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            got = [await ps.step(lambda: dist.step(0), 0)]
            os.kill(fleet.stack.procs["worker-3"].popen.pid, signal.SIGSTOP)
            for s in range(1, job.steps):
                got.append(await asyncio.wait_for(ps.step(lambda s=s: dist.step(s), s), 30))
            os.kill(fleet.stack.procs["worker-3"].popen.pid, signal.SIGCONT)
            assert_same(got, reference(job))
            assert ps.dispatcher.c.copied > 0
    finally:
        fleet.stop()
