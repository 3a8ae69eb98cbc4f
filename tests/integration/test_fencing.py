"""Two PSs for one job (a restart while the old one still runs): exactly one survives. A PS claims its epoch
and the head in one compare-and-set, so an older PS's commit cannot land after the newer one has loaded; and
when it landed just before, the newer PS (whose epoch is still current) writes over it instead of exiting."""

from __future__ import annotations

import pytest

from cleave import bus as busmod
from cleave.errors import Fenced
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.state.persist import Persister, snapshot


class Racing(Persister):
    """A PS whose next commit is overtaken right after its epoch check: `between` runs there (another PS
    claiming the job), as it can when two processes interleave."""

    between = None

    async def _check_epoch(self) -> None:
        await super()._check_epoch()
        if self.between is not None:
            step, self.between = self.between, None
            await step()


async def persisters(nats_url: str, job: JobConfig):  # noqa: ANN201
    buses = [await busmod.connect(nats_url, name) for name in ("old", "new")]
    await buses[0].setup()
    old = Racing(buses[0], job.job_id, job.model_dump_json())
    new = Persister(buses[1], job.job_id, job.model_dump_json())
    for p in (old, new):
        await p.open()
    return buses, old, new


async def test_an_older_ps_that_passed_its_check_cannot_land_after_the_newer_one_claimed(nats_url):
    """The old PS passes its epoch check; the new one claims and loads; the old one's head write is then
    refused (Fenced) and the new one commits: one survivor, not two fenced PSs."""
    job = JobConfig(job_id="race", preset="tiny", steps=3)
    trainer = Trainer(job)
    buses, old, new = await persisters(nats_url, job)
    try:
        assert await old.claim_epoch() == 1
        await old.commit(snapshot(trainer.model, trainer.opt, job.job_id, 0, old.epoch), ())
        loaded = []

        async def new_ps_starts() -> None:
            assert await new.claim_epoch() == 2
            fresh = Trainer(job)
            loaded.append(await new.load(fresh.model, fresh.opt))

        old.between = new_ps_starts
        with pytest.raises(Fenced):
            await old.commit(snapshot(trainer.model, trainer.opt, job.job_id, 1, old.epoch), ())
        assert loaded[0].step == 0 and loaded[0].epoch == 2  # the head it claimed: step 0, now its epoch
        head = await new.commit(snapshot(trainer.model, trainer.opt, job.job_id, 1, new.epoch), ())
        assert (head.step, head.epoch) == (1, 2)
        with pytest.raises(Fenced):  # and the old one stays fenced
            await old.commit(snapshot(trainer.model, trainer.opt, job.job_id, 2, old.epoch), ())
    finally:
        for b in buses:
            await b.close()


async def test_a_newer_ps_writes_over_a_commit_that_landed_before_its_first(nats_url):
    """A new job: the new PS claims (there is no head yet), then the old one's first commit lands. The new
    PS's first commit conflicts; its epoch is still the current one, so it reads the head again and writes
    over it instead of exiting; the old one is fenced at its next commit."""
    job = JobConfig(job_id="race-new", preset="tiny", steps=3)
    trainer = Trainer(job)
    buses, old, new = await persisters(nats_url, job)
    try:
        assert await old.claim_epoch() == 1

        async def new_ps_starts() -> None:
            assert await new.claim_epoch() == 2
            fresh = Trainer(job)
            assert await new.load(fresh.model, fresh.opt) is None  # nothing committed yet

        old.between = new_ps_starts
        await old.commit(snapshot(trainer.model, trainer.opt, job.job_id, 0, old.epoch), ())  # it lands
        head = await new.commit(snapshot(trainer.model, trainer.opt, job.job_id, 0, new.epoch), ())
        assert (head.step, head.epoch) == (0, 2)
        with pytest.raises(Fenced):
            await old.commit(snapshot(trainer.model, trainer.opt, job.job_id, 1, old.epoch), ())
        reloaded = Persister(buses[1], job.job_id, job.model_dump_json())
        await reloaded.open()
        fresh = Trainer(job)
        assert (await reloaded.load(fresh.model, fresh.opt)).epoch == 2
    finally:
        for b in buses:
            await b.close()
