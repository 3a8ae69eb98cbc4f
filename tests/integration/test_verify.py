"""Lying workers: sampled tiles are computed twice; a worker returning subtly wrong blocks is caught,
excluded, and the step is redone without it, so the model stays the reference's."""

from __future__ import annotations

from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import InProcessPS, assert_same, start_fleet


async def test_a_subtly_lying_worker_is_caught_and_excluded(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=4)
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    fleet.stack.service("liar", "worker", ["--worker-id", "liar"], env={"CLEAVE_WORKER_CORRUPT": "0.01"},
                        restart=False)
    try:
        async with InProcessPS(nats_url, verify_fraction=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            got = []
            for s in range(job.steps):
                while True:  # what the PS's job loop does on a spoiled step
                    try:
                        got.append(await ps.step(lambda s=s: dist.step(s), s))
                        break
                    except Exception as e:  # StepSpoiled crosses the autograd boundary unchanged
                        assert type(e).__name__ == "StepSpoiled", repr(e)
            trainer = Trainer(job)
            assert_same(got, [trainer.step(s) for s in range(job.steps)])
            assert ps.dispatcher.faulty == {"liar"}
            assert "liar" not in ps.dispatcher.workers
            assert any(ev.kind == "worker_faulty" and ev.worker_id == "liar" for ev in ps.dispatcher.c.recoveries)
            assert ps.dispatcher.verifier.done > 0
    finally:
        fleet.stop()
