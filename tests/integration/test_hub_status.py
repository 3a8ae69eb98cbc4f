"""`cleave status` tells a job whose runner is gone from one that runs, and a submission no runner has taken
from a job the hub does not know. It showed a job whose runner had died as `running` for ever, and said 'the
hub knows no job' of a job `cleave submit` had just said waits on the hub. A real nats-server; the runner's
own code stamps the records (`Runner.vouch`)."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from pathlib import Path

import pytest
import torch

from cleave import bus as busmod
from cleave import codec
from cleave.api import hub
from cleave.api.stack import Stack
from cleave.errors import StepAborted
from cleave.schemas import JOBS_BUCKET, SUBJECT_JOB_SUBMIT, Event, JobRecord, JobSubmission, StepMetrics
from cleave.schemas.jobs import RUNNER_REFRESH_S, RUNNER_SILENT_S, WAIT_EVENT_S, waiting_for_workers
from cleave.train.job import JobConfig
from cleave_cli.main import main
from cleave_cli.runner import Runner, jobs_stream
from cleave_ps.fleet.idle import NOTICE_S, WaitNotice
from cleave_ps.fleet.plans import PlanWatch
from tests.integration.fleet import InProcessPS

GONE_S = 600.0  # how long ago the dead runner last stamped its record


def _record(job_id: str, state: str, heard_at: float | None) -> JobRecord:
    job = JobConfig.build(job_id=job_id, preset="tiny", steps=8)
    return JobRecord(job_id=job_id, job=job.model_dump_json(), state=state, submitted_at=time.time() - 900,
                     runs=1, heard_at=heard_at)


async def _seed(nats_url: str) -> None:
    """What a hub whose runner died holds: a running job last stamped GONE_S ago with two steps reported, a done
    job, and a submission no runner has taken."""
    bus = await busmod.connect(nats_url, "test")
    await bus.setup()
    await jobs_stream(bus)
    kv = await bus.kv(JOBS_BUCKET)
    now = time.time()
    await bus.kv_put(kv, "orphan", _record("orphan", "running", now - GONE_S))
    await bus.kv_put(kv, "finished", _record("finished", "done", now - GONE_S))
    for step, loss in enumerate((5.5, 5.25)):
        await bus.emit(StepMetrics(job="orphan", step=step, loss=loss, step_time_s=0.1, workers=2))
    await bus.emit(StepMetrics(job="finished", step=7, loss=3.0, step_time_s=0.1, workers=2))
    sub = JobSubmission(job=JobConfig.build(job_id="later", preset="tiny").model_dump_json(),
                        nonce=secrets.token_hex(8), submitted_at=now)
    await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job="later"), codec.encode(sub))
    await bus.close()


def test_status_says_a_runner_is_gone_and_a_submission_waits(nats_url: str, capsys: pytest.CaptureFixture) -> None:
    asyncio.run(_seed(nats_url))
    assert main(["status", "--nats", nats_url, "--job-id", "orphan"]) == 0
    said = capsys.readouterr().out
    assert "orphan: running, step 1 (2/8 done), loss 5.2500" in said and "not heard from the hub's runner for 10 min" \
        in said, said
    assert main(["status", "--nats", nats_url, "--job-id", "finished"]) == 0
    assert "not heard" not in capsys.readouterr().out  # a job that ended needs no runner
    assert main(["status", "--nats", nats_url, "--job-id", "later"]) == 0
    assert "later: submitted, waiting on the hub for its runner to take it" in capsys.readouterr().out
    assert main(["status", "--nats", nats_url, "--job-id", "later", "--json"]) == 0  # (it printed the text)
    assert json.loads(capsys.readouterr().out) == {"job": "later", "state": "submitted", "runner_silent_s": None}
    assert main(["status", "--nats", nats_url]) == 0
    listed = {x.split()[0]: x for x in capsys.readouterr().out.splitlines()}
    assert sorted(listed) == ["finished", "later", "orphan"] and "not heard" in listed["orphan"], listed
    assert "waiting on the hub for its runner" in listed["later"] and "not heard" not in listed["finished"]
    assert main(["status", "--nats", nats_url, "--json"]) == 0
    views = {v["job"]: v for v in json.loads(capsys.readouterr().out)}
    assert views["later"]["state"] == "submitted"
    assert (views["orphan"]["step"], views["orphan"]["loss"], views["finished"]["step"]) == (1, 5.25, 7)
    assert abs(views["orphan"]["runner_silent_s"] - GONE_S) < 60 and views["finished"]["runner_silent_s"] is None
    assert sorted(v["job"] for v in hub.status(nats_url)) == ["finished", "orphan"]  # the API: the records


def test_status_reads_each_records_latest_value_and_one_whose_description_is_no_json(
        nats_url: str, capsys: pytest.CaptureFixture) -> None:
    """An older runner kept a refused submission's text as it came: `cleave status` ended on it with a
    JSONDecodeError, for every user. The records are read in one pass (one request a key took 8-26 s for 10,000):
    each key's latest value, a deleted one not at all."""

    async def seed() -> None:
        bus = await busmod.connect(nats_url, "test")
        await bus.setup()
        kv = await bus.kv(JOBS_BUCKET)
        await bus.kv_put(kv, "old-refused", JobRecord(job_id="old-refused", job="[not json", state="failed",
                                                      submitted_at=time.time() - 60, reason="invalid job"))
        await bus.kv_put(kv, "again", _record("again", "queued", None))
        await bus.kv_put(kv, "again", _record("again", "done", None))
        await bus.kv_put(kv, "gone", _record("gone", "done", None))
        await kv.delete("gone")
        await bus.close()

    asyncio.run(seed())
    views = {v["job"]: v for v in hub.status(nats_url)}
    assert sorted(views) == ["again", "old-refused"] and views["again"]["state"] == "done", views
    assert (views["old-refused"]["steps"], views["old-refused"]["method"]) == (None, "cleave")
    assert main(["status", "--nats", nats_url]) == 0
    listed = {x.split()[0]: x.split()[1] for x in capsys.readouterr().out.splitlines()}
    assert listed == {"again": "done", "old-refused": "failed"}, listed


def test_a_live_runner_stamps_its_queued_and_running_jobs(nats_url: str, tmp_path: Path) -> None:
    async def go() -> dict[str, float | None]:
        bus = await busmod.connect(nats_url, "test")
        await bus.setup()
        runner = Runner(bus, Stack(tmp_path / "run"), tmp_path / "run", max_running=1)
        runner.kv = await bus.kv(JOBS_BUCKET)
        now = time.time()
        for job_id, state, at in (("old", "running", now - RUNNER_REFRESH_S - 1), ("fresh", "queued", now - 1),
                                  ("ended", "failed", now - RUNNER_SILENT_S * 2)):
            runner.records[job_id] = _record(job_id, state, at)
        await runner.vouch()
        stamped = {k: (await bus.kv_get(runner.kv, k, JobRecord)) for k in ("old", "fresh", "ended")}
        await bus.close()
        return {k: got[0].heard_at if got else None for k, got in stamped.items()}

    stamped = asyncio.run(go())
    assert stamped["old"] is not None and time.time() - stamped["old"] < 30  # written again, stamped now
    assert stamped["fresh"] is None and stamped["ended"] is None  # stamped recently / ended: not written


def test_a_queued_job_says_how_many_workers_it_waits_for(nats_url: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """A job submitted with --workers 50 to a hub with 13 showed `queued, no step yet` for a minute, with no
    reason."""

    async def go() -> None:
        bus = await busmod.connect(nats_url, "test")
        await bus.setup()
        runner = Runner(bus, Stack(tmp_path / "run"), tmp_path / "run", max_running=1)
        await runner.open()
        await runner.put(_record("big", "queued", time.time()).model_copy(update={"min_workers": 50}))
        await runner.tick()
        assert not runner.stack.procs  # not started: it waits
        await runner.close()
        await bus.close()

    asyncio.run(go())
    assert main(["status", "--nats", nats_url, "--job-id", "big"]) == 0
    assert re.search(r"big: queued, no step yet of 8; waiting for 50 workers \(0 registered\): it starts with "
                     r"those there by \d\d:\d\d:\d\d", capsys.readouterr().out)


def test_status_says_a_running_job_waits_for_workers(nats_url: str, capsys: pytest.CaptureFixture) -> None:
    """A job whose PS has no worker to deal to (none came, every one left, or every one was expelled for wrong
    results) showed as running at its last step, and nothing more. Here the PS's own dispatcher deals a GEMM to an
    empty fleet (one worker expelled before), and a round method's PS waits for a plan with workers."""

    async def status(*flags: str) -> str:
        assert await asyncio.to_thread(main, ["status", "--nats", nats_url, *flags]) == 0
        return capsys.readouterr().out

    async def go() -> None:
        async with InProcessPS(nats_url, job_id="idle") as ps:
            kv = await ps.bus.kv(JOBS_BUCKET)
            now = time.time()
            for job_id in ("idle", "rounds"):
                await ps.bus.kv_put(kv, job_id, _record(job_id, "running", now).model_copy(update={"started_at": now}))
            await ps.bus.emit(StepMetrics(job="idle", step=0, loss=5.0, step_time_s=0.1, workers=1, at=now))
            ps.dispatcher.faulty.add("liar")  # what expelling it left: never dealt to again
            gemm = asyncio.create_task(ps.dispatcher.gemm(torch.ones(8, 4), torch.ones(8, 4), 1, 0, "x"))
            plans, stop = PlanWatch(ps.bus, key="nobody"), asyncio.Event()
            notice = WaitNotice(ps.bus, "rounds", NOTICE_S)
            rounds = asyncio.create_task(plans.some_workers(stop, lambda: notice.waiting(4)))
            for _ in range(int(8 * NOTICE_S)):  # (each read that finds nothing new takes a while too)
                if len(await hub.read_waits(ps.bus)) == 2:
                    break
                await asyncio.sleep(0.5)
            said = await status("--job-id", "idle")
            # (without the worker count of its last step, which read as a contradiction; 'for 0 min' was 'for 3s')
            assert re.search(r"idle: running, step 0 \(1/8 done\), loss 5\.0000; waiting for workers: its PS has had "
                             r"none to deal to for \d+s \(since ", said) and "1 expelled for wrong results" in said, said
            view = json.loads(await status("--job-id", "rounds", "--json"))
            assert view["waiting_for_workers"]["step"] == 4 and view["waiting_for_workers"]["faulty"] == 0, view
            listed = {x.split()[0]: x for x in (await status()).splitlines()}
            assert all("waiting for workers" in listed[j] for j in ("idle", "rounds")), listed
            # a step reported after the word: the wait is over
            await ps.bus.emit(StepMetrics(job="idle", step=1, loss=4.0, step_time_s=0.1, workers=1, at=time.time()))
            assert "waiting" not in await status("--job-id", "idle")
            stop.set()
            ps.dispatcher.stopping = True
            with pytest.raises(StepAborted):
                await gemm
            assert await rounds == frozenset()

    asyncio.run(go())


def test_a_word_of_waiting_holds_while_it_is_fresh_and_the_latest() -> None:
    now = time.time()
    word = Event(kind="waiting_for_workers", at=now - 10, job="j", step=3, detail={"since": now - 100, "faulty": 2})
    assert waiting_for_workers("running", word, now - 20, None, now) == {"since": now - 100, "step": 3, "faulty": 2}
    assert waiting_for_workers("running", word, now - 5, None, now) is None  # a step came after it
    assert waiting_for_workers("running", word, None, now - 5, now) is None  # said by a PS before the last one
    assert waiting_for_workers("done", word, now - 20, None, now) is None
    assert waiting_for_workers("running", None, now - 20, None, now) is None
    stale = word.model_copy(update={"at": now - 3 * WAIT_EVENT_S - 1})  # its PS said nothing since: gone
    assert waiting_for_workers("running", stale, None, None, now) is None


def test_an_empty_hub_says_which_jobs_it_lists(capsys: pytest.CaptureFixture) -> None:
    """After a `cleave train --nats` job, `cleave status` said only 'no jobs on this hub'."""
    from cleave_cli.jobs_cmd import show_list  # noqa: PLC0415

    show_list([], {}, {}, [], as_json=False)
    out = capsys.readouterr().out
    assert out.startswith("no jobs on this hub") and "cleave submit" in out and "cleave train --nats" in out


def test_each_jobs_latest_word_and_step_line_are_read_and_counted(nats_url: str) -> None:
    """`cleave status` reads each job's latest step line, wait and trim, and how many step lines it has, from
    the events stream filed by job, not every event: the latest wins whatever came before, a job's own only."""
    a, b = f"a-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"

    async def go() -> None:
        bus = await busmod.connect(nats_url, "test-lasts")
        try:
            await bus.setup()
            for step in range(5):
                await bus.emit(StepMetrics(job=a, step=step, loss=5.0 - step, step_time_s=0.1, workers=2))
                await bus.emit(Event(kind="waiting_for_workers", at=float(step), job=a, step=step))
            await bus.emit(StepMetrics(job=b, step=0, loss=9.0, step_time_s=0.1, workers=1))
            await bus.emit(Event(kind="trimmed_drops_nothing", at=1.0, job=b, step=0, detail={"updates": 2}))
            lasts = await hub.read_lasts(bus)
            assert (lasts[a][0].step, lasts[a][0].loss, lasts[a][1]) == (4, 1.0, 5)
            assert (lasts[b][0].step, lasts[b][1]) == (0, 1)
            assert list(await hub.read_lasts(bus, b)) == [b]
            waits = await hub.read_waits(bus)
            assert waits[a].step == 4 and b not in waits
            assert list(await hub.read_trims(bus, b)) == [b] and await hub.read_trims(bus, a) == {}
            assert [m.step for m in await hub.read_metrics(bus, a)] == [0, 1, 2, 3, 4]
            lines, past = await hub.read_new_metrics(bus, a)  # what `follow` reads: each line once
            assert [m.step for m in lines] == [0, 1, 2, 3, 4]
            assert await hub.read_new_metrics(bus, a, past) == ([], past)
            await bus.emit(StepMetrics(job=b, step=1, loss=8.0, step_time_s=0.1, workers=1))
            await bus.emit(StepMetrics(job=a, step=5, loss=0.5, step_time_s=0.1, workers=2))
            lines, newer = await hub.read_new_metrics(bus, a, past)
            assert [m.step for m in lines] == [5] and newer > past
        finally:
            await bus.close()

    asyncio.run(go())
