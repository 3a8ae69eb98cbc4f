"""The round policy of diloco and fedavg over a real nats-server and worker processes: validation after a
round (and after a split-learning step), `min_updates`, and `max_staleness` with a straggler."""

from __future__ import annotations

import asyncio
import time

import pytest

from cleave import bus as busmod
from cleave.api import hub
from cleave.api.fleet import LocalFleet
from cleave.schemas import JobRecord
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_cli.jobs_cmd import line
from tests.integration.fleet import assert_same

SLOW = "flops=5e8,down=1e9,up=1e9,latency=0,memory=4Gi"  # a round of tiny at H=2 takes ~1.5 s there


def run_job(tmp_path, job: JobConfig, workers: int, extra: dict[str, list[str]] | None = None,
            nats_url: str | None = None) -> list[dict]:
    """The job on `workers` workers plus one worker per `extra` entry (name -> its extra arguments); on the
    nats-server at `nats_url`, which outlives the stack, if given."""
    fleet = LocalFleet(tmp_path / "run", workers, nats_url=nats_url)
    try:
        fleet.start()
        for name, argv in (extra or {}).items():
            fleet.stack.service(name, "worker", ["--worker-id", name, *argv], restart=False)
        fleet.start_ps(job, tmp_path / "m.jsonl")
        return fleet.wait_ps(tmp_path / "m.jsonl", timeout_s=240)
    finally:
        fleet.stop()


@pytest.mark.parametrize("method", ["diloco", pytest.param("fedavg", marks=pytest.mark.slow), "split"])  # (~11 s each)
def test_val_every_is_the_validation_loss_of_the_ps_model(tmp_path, method):
    """One worker and one local step (diloco: outer lr 1, no momentum) is plain training, and so is split
    learning: the validation loss after rounds (steps) 2 and 4 is the reference run's after steps 2 and 4."""
    extra = {"diloco": dict(local_steps=1, outer_lr=1.0, outer_momentum=0.0), "fedavg": dict(local_steps=1),
             "split": dict(split_layers=1)}[method]
    job = JobConfig(job_id=f"val-{method}", preset="tiny", steps=4, method=method, val_every=2, **extra)
    lines = run_job(tmp_path, job, workers=1)
    trainer, want = Trainer(JobConfig(preset="tiny", steps=4)), []
    for s in range(4):
        trainer.step(s)
        want.append(trainer.val_loss(s) if s % 2 else None)
    assert [m["val_loss"] is None for m in lines] == [w is None for w in want]
    assert_same([m["val_loss"] for m in lines[1::2]], want[1::2])


@pytest.mark.parametrize("min_updates", [pytest.param(0, marks=pytest.mark.slow), 3])  # (~10 s each)
def test_min_updates_decides_whether_a_round_applies(tmp_path, min_updates, nats_url):
    """Two workers: with min_updates 0 every round applies both updates; with 3 the round closes when both
    answered (no one else is in the plan) and applies nothing. (A trimmed mean of two drops nothing: the PS says
    so, once, in its log and in the events stream, and `cleave status` beside the job: it was the plain mean
    unsaid, and on a hub only the PS's log said it.)"""
    job = JobConfig(job_id=f"min-{min_updates}", preset="tiny", steps=3, method="fedavg", local_steps=1,
                    min_updates=min_updates, round_timeout_s=60, aggregate="trimmed")
    lines = run_job(tmp_path, job, workers=2, nats_url=nats_url)
    assert [m["updates"] for m in lines] == [2, 2, 2]
    assert [m["applied"] for m in lines] == [min_updates == 0] * 3
    log = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert log.count("trimmed_drops_nothing") == 1 and "updates=2" in log

    async def said() -> dict:
        bus = await busmod.connect(nats_url, "status")
        try:
            return await hub.read_trims(bus)
        finally:
            await bus.close()

    word = asyncio.run(said())[job.job_id]
    assert (word.step, word.detail) == (0, {"updates": 2, "trim": 0.2}), word
    rec = JobRecord(job_id=job.job_id, job=job.model_dump_json(), state="done", submitted_at=time.time())
    view = hub.summary(rec, trim=word)
    assert view["trimmed_drops_nothing"] == {"round": 0, "updates": 2, "trim": 0.2}
    assert "its trimmed mean dropped nothing in round 0 (2 updates, too few for trim 0.2)" in line(view), line(view)


@pytest.mark.parametrize("max_staleness", [0, pytest.param(50, marks=pytest.mark.slow)])  # (~12 s each)
def test_max_staleness_decides_whether_a_straggler_counts(tmp_path, max_staleness):
    """min_updates 1: rounds close on the fast worker's update; a straggler (a declared slow device) answers
    rounds long closed. Within max_staleness its updates are folded in, otherwise dropped and counted."""
    job = JobConfig(job_id=f"stale-{max_staleness}", preset="tiny", steps=40, method="diloco", local_steps=2,
                    min_updates=1, max_staleness=max_staleness, round_timeout_s=60)
    lines = run_job(tmp_path, job, workers=1, extra={"straggler": ["--profile", SLOW]})
    late, dropped = sum(m["updates_late"] for m in lines), sum(m["updates_dropped"] for m in lines)
    if max_staleness:
        assert late >= 1 and dropped == 0, (late, dropped)
    else:
        assert late == 0 and dropped >= 1, (late, dropped)
        # the PS log says why: late, not "not dealt that round" (it was dealt them)
        log = (tmp_path / "run" / "logs" / "ps.log").read_text()
        assert "update from straggler" in log and "reason=not_member" not in log
    assert all(m["applied"] for m in lines)
