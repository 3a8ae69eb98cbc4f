"""The hub's runner under a hostile submitter (one holding the submit credential): a real nats-server, the
runner's own code, and real PS processes where a job starts.

- A device or a pipe named as a job's tokenizer or data was queued: its PS, once started, refused it (after the
  jobs before it), or would have read /dev/zero for ever; the runner refuses it when it judges the submission.
- Thousands of submissions were all queued, and a refused one's text was kept in its record: the runner held
  every one in memory, and a text that is no JSON object ended `cleave status` for everyone. At most
  `max_queued` jobs wait; a refused new job's record keeps no text, and at most `max_refused` such records are
  kept (a flood of invalid jobs filled the records' bucket, and a full bucket stopped the runner).
- A PS that fails at start every time: its job fails after 5 tries, with a reason that says it was a crash loop,
  and the next job starts.
- A full records' bucket (the jobs that ran filled it): a new job's record could not be written, and the runner
  was handed its submission again until it dropped it (MAX_DELIVER), said only as a ServiceUnavailableError. It
  takes no submission while the bucket is full; the one it could not record is recorded once there is room.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig

from cleave import bus as busmod
from cleave import codec
from cleave.api.stack import Stack
from cleave.schemas import JOBS_BUCKET, SUBJECT_JOB_SUBMIT, JobRecord, JobSubmission
from cleave.schemas.subjects import kv_stream, kv_subject
from cleave.train.job import JobConfig
from cleave_cli.main import main
from cleave_cli.runner import Runner

OP_TIMEOUT_S = 120.0
# (in every process that starts with it, the stack's fork server too, whose forks are the services: the PS of job
# `crashy` ends as it starts)
CRASH = """import os, sys
import cleave_cli.main as _main
_run_service = _main.run_service
def _crashy(args):
    if args.command == "ps" and "/jobs/crashy/" in str(args.job):
        sys.stderr.write("simulated broken install: this PS crashes at start\\n")
        os._exit(1)
    return _run_service(args)
_main.run_service = _crashy
"""


def _job(job_id: str, **settings: object) -> str:
    return JobConfig.build(**{"job_id": job_id, "preset": "tiny", "steps": 2, "batch_size": 2, **settings}).model_dump_json()


async def _submit(bus: busmod.Bus, job_id: str, text: str, nonce: int) -> None:
    sub = JobSubmission(job=text, nonce=f"{nonce:016x}", submitted_at=time.time())
    await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job=job_id), codec.encode(sub))


async def _runner(nats_url: str, run: Path, **kw: object) -> tuple[busmod.Bus, Runner]:
    bus = await busmod.connect(nats_url, "test")
    await bus.setup()
    stack = Stack(run)
    stack.nats_url = nats_url
    runner = Runner(bus, stack, run, max_running=1, **kw)
    await runner.open()
    return bus, runner


async def _judged(runner: Runner, job_id: str, nonce: int) -> JobRecord:
    async with asyncio.timeout(OP_TIMEOUT_S):
        while (rec := runner.records.get(job_id)) is None or rec.nonce != f"{nonce:016x}":
            await runner.take()
    return rec


def test_a_device_or_a_pipe_as_tokenizer_or_data_is_refused_when_judged(nats_url: str, tmp_path: Path) -> None:
    fifo, tokdir, text = tmp_path / "fifo", tmp_path / "tok", tmp_path / "text.txt"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "fifo.json")
    tokdir.mkdir()
    os.mkfifo(tokdir / "tokenizer.json")
    text.write_text("some text to train on\n" * 300)
    (tmp_path / "short.txt").write_text("too short to train on\n")
    (tmp_path / "doc.pdf").write_bytes(bytes(range(256)) * 64)
    hostile = {"t-fifo": {"tokenizer": str(fifo)}, "t-fifojson": {"tokenizer": str(tmp_path / "fifo.json")},
               "t-dir": {"tokenizer": str(tokdir)}, "t-zero": {"tokenizer": "/dev/zero"},
               "t-stdin": {"tokenizer": "/dev/stdin"}, "d-fifo": {"data": str(fifo)}, "d-zero": {"data": "/dev/zero"},
               "d-stdin": {"data": "/dev/stdin"}, "t-none": {"tokenizer": str(tmp_path / "nothing")},
               "d-none": {"data": str(tmp_path / "nothing.txt")}, "d-short": {"data": str(tmp_path / "short.txt")},
               "d-binary": {"data": str(tmp_path / "doc.pdf")}}
    honest = {"builtin": {}, "a-file": {"data": str(text)}}

    async def go() -> dict[str, JobRecord]:
        bus, runner = await _runner(nats_url, tmp_path / "run")
        try:
            for i, (job_id, settings) in enumerate({**hostile, **honest}.items()):
                await _submit(bus, job_id, _job(job_id, **settings), i)
            start = time.monotonic()
            recs = {job_id: await _judged(runner, job_id, i) for i, job_id in enumerate({**hostile, **honest})}
            assert time.monotonic() - start < 30  # nothing blocked its judging (a pipe waits for a writer)
            assert not runner.stack.procs  # no PS was started for any
            return recs
        finally:
            await runner.close()
            await bus.close()

    recs = asyncio.run(go())
    for job_id in hostile:
        assert (recs[job_id].state, recs[job_id].verdict) == ("failed", "refused"), (job_id, recs[job_id])
    for job_id in ("t-fifo", "t-fifojson", "t-zero", "d-fifo", "d-zero"):
        assert "is not a regular file (a device, pipe or socket)" in recs[job_id].reason, recs[job_id].reason
    assert recs["t-zero"].reason.startswith("tokenizer='/dev/zero'") and recs["d-zero"].reason.startswith("data=")
    assert "has 22 tokens; need at least" in recs["d-short"].reason and "it is no text (it looks binary" in recs["d-binary"].reason, recs  # (their
    # PSs failed 8 s into their runs)
    for job_id in honest:
        assert (recs[job_id].state, recs[job_id].verdict) == ("queued", "accepted"), recs[job_id]


def test_a_flood_of_submissions_stops_at_the_queues_limit_and_status_reads_every_record(
        nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    junk = {"junk-text": "x" * 60_000, "junk-list": "[1, 2]", "junk-deep": "[" * 5000}  # none a JSON object

    async def go() -> dict[str, JobRecord]:
        bus, runner = await _runner(nats_url, tmp_path / "run", max_queued=3)
        try:
            for i, (job_id, text) in enumerate(junk.items(), 10):  # (first: later, the queue is full)
                await _submit(bus, job_id, text, i)
            for i in range(5):
                await _submit(bus, f"q{i}", _job(f"q{i}"), i)
            await _submit(bus, "q0", _job("q0", seed=1), 20)  # one waiting, submitted again: it still waits
            recs = {f"q{i}": await _judged(runner, f"q{i}", i) for i in range(1, 5)}
            recs |= {job_id: await _judged(runner, job_id, i) for i, job_id in enumerate(junk, 10)}
            recs["q0"] = await _judged(runner, "q0", 20)
            return recs
        finally:
            await runner.close()
            await bus.close()

    recs = asyncio.run(go())
    assert [recs[f"q{i}"].state for i in range(5)] == ["queued"] * 3 + ["failed"] * 2
    assert recs["q0"].verdict == "accepted" and '"seed":1' in recs["q0"].job
    for job_id in ("q3", "q4"):
        assert recs[job_id].verdict == "refused" and "the hub's queue is full: 3 jobs wait" in recs[job_id].reason
    for job_id in junk:
        assert recs[job_id].verdict == "refused" and len(recs[job_id].job) < 100  # (its text is not kept)
    capsys.readouterr()  # (the runner's log)
    assert main(["status", "--nats", nats_url]) == 0  # (a record holding the junk ended it: JSONDecodeError)
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert sorted(listed) == sorted([*junk, "q0", "q1", "q2", "q3", "q4"]), listed
    assert "queue is full" in listed["q4"] and "not a valid job" in listed["junk-text"]


def test_the_records_of_refused_new_jobs_are_bounded_the_oldest_removed(nats_url: str, tmp_path: Path) -> None:
    """Each invalid submission on a new id left a record for ever: a flood filled the records' bucket, and once it
    was full the runner wrote no record at all (it retried, ServiceUnavailableError, and no job started or
    ended). Past `max_refused` such records, the oldest is removed, every revision of it."""

    async def go() -> None:
        bus, runner = await _runner(nats_url, tmp_path / "run", max_refused=3)
        try:
            await _submit(bus, "kept", _job("kept"), 0)
            for i in range(1, 7):
                await _submit(bus, f"bad{i}", '{"preset": "no-such-model"}', i)
            await _submit(bus, "bad6", _job("bad6"), 7)  # refused when new, then accepted: no longer counted
            await _judged(runner, "bad6", 7)
            stream = await bus.js.stream_info(f"KV_{JOBS_BUCKET}", subjects_filter=f"$KV.{JOBS_BUCKET}.>")
            assert sorted(k.rsplit(".", 1)[-1] for k in stream.state.subjects) == ["bad4", "bad5", "bad6", "kept"]
            assert sorted(runner.records) == ["bad4", "bad5", "bad6", "kept"]
            assert list(runner.refused) == ["bad4", "bad5"]
            kept = (await bus.kv_get(runner.kv, "bad5", JobRecord))[0]
            assert kept.verdict == "refused" and "no-such-model" in kept.reason
            assert runner.records["bad6"].state == runner.records["kept"].state == "queued"
        finally:
            await runner.close()
            await bus.close()
        again = (await _runner(nats_url, tmp_path / "run", max_refused=2))  # a runner started again: the same
        try:
            assert list(again[1].refused) == ["bad4", "bad5"]
            await _submit(again[0], "bad7", "[]", 8)
            await _judged(again[1], "bad7", 8)
            assert list(again[1].refused) == ["bad5", "bad7"]
        finally:
            await again[1].close()
            await again[0].close()

    asyncio.run(go())


def test_a_ps_in_a_crash_loop_fails_its_job_saying_so_and_the_next_job_starts(
        nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "crash").mkdir()
    (tmp_path / "crash" / "sitecustomize.py").write_text(CRASH)  # (only the PS of job `crashy`)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "crash"), os.environ.get("PYTHONPATH", "")]))

    async def go() -> dict[str, JobRecord]:
        bus, runner = await _runner(nats_url, tmp_path / "run")
        try:
            await _submit(bus, "crashy", _job("crashy"), 1)
            await _submit(bus, "next", _job("next", steps=100_000), 2)
            async with asyncio.timeout(OP_TIMEOUT_S):
                while (rec := runner.records.get("next")) is None or rec.state != "running":
                    await runner.take()
                    await runner.tick()
            return dict(runner.records)
        finally:
            await asyncio.to_thread(runner.stack.stop_all)
            await runner.close()
            await bus.close()

    recs = asyncio.run(go())
    crashy = recs["crashy"]
    assert (crashy.state, crashy.exit_code, crashy.runs) == ("failed", 1, 5), crashy
    assert crashy.reason.startswith("its PS failed 5 times in a row, each within 60 s of its start"), crashy.reason
    assert "simulated broken install: this PS crashes at start" in crashy.reason


def test_a_submission_waits_while_the_records_bucket_is_full(nats_url: str, tmp_path: Path) -> None:
    ack_wait_s = 1.0  # (60 s on a hub: a submission not acknowledged is handed over again after this)

    async def go() -> tuple[int, JobRecord]:
        admin = await busmod.connect(nats_url, "admin")
        await admin.js.create_key_value(KeyValueConfig(bucket=JOBS_BUCKET, max_bytes=256 * 1024))
        kv, fillers = await admin.kv(JOBS_BUCKET), 0
        with contextlib.suppress(nats.js.errors.APIError):  # filled to the brim (by jobs that ran, on a hub)
            while True:
                await kv.put(f"filler.{fillers}", b"x" * 1000)
                fillers += 1
        bus, runner = await _runner(nats_url, tmp_path / "run", ack_wait_s=ack_wait_s)
        try:
            await _submit(bus, "new", _job("new"), 1)
            with pytest.raises(nats.js.errors.APIError, match="maximum bytes exceeded"):
                async with asyncio.timeout(OP_TIMEOUT_S):
                    while True:
                        await runner.take()
            assert runner.full and "new" not in runner.records
            for _ in range(int(6 * ack_wait_s / 0.25)):  # past its acknowledgement's wait, over and over
                await runner.take()
                await asyncio.sleep(0.25)
            handed = (await runner.sub.consumer_info()).num_redelivered
            await admin.js.purge_stream(kv_stream(JOBS_BUCKET), subject=kv_subject(JOBS_BUCKET, "filler.>"))
            return handed, await _judged(runner, "new", 1)
        finally:
            await runner.close()
            await bus.close()
            await admin.close()

    handed, rec = asyncio.run(go())
    assert handed == 0 and (rec.state, rec.verdict) == ("queued", "accepted"), (handed, rec)
