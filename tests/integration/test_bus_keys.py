"""A bucket's keys come from its stream's state in one request (`Bus.keys`), never from nats-py's `kv.keys()`:
that one lists them with a watch which, on a busy server, can end before its first key and say the bucket is
empty. A hub's runner that restarted read "no jobs" that way once and never resumed the job it had been running
(the compose end-to-end run: the runner killed mid-job, step 110 never reached)."""

from __future__ import annotations

import time

import pytest
from nats.js.errors import NoKeysError

from cleave import bus as busmod
from cleave.api.stack import Stack
from cleave.schemas import JOBS_BUCKET, JobRecord
from cleave.train.job import JobConfig
from cleave_cli.runner import Runner


def _empty_watch(kv) -> None:  # noqa: ANN001 - a nats-py KeyValue
    """nats-py's key listing as it fails under load: its watch ended before the first key."""
    async def keys(*args, **kwargs) -> list[str]:
        raise NoKeysError

    kv.keys = keys


async def test_keys_are_every_key_of_the_bucket_and_only_those(nats_url):
    bus = await busmod.connect(nats_url, "keys-test")
    try:
        kv, other = await bus.kv("keys-test"), await bus.kv("keys-other")
        assert await bus.keys(kv) == []
        for key in ("job-b", "job-a", "job-c.head"):
            await kv.put(key, b"x")
        await other.put("elsewhere", b"x")
        await kv.delete("job-b")
        _empty_watch(kv)
        assert await bus.keys(kv) == ["job-a", "job-b", "job-c.head"]  # a deleted key is listed ...
        assert await bus.kv_get(kv, "job-b", JobRecord) is None  # ... and reads as absent
        assert await bus.keys(other) == ["elsewhere"]
    finally:
        await bus.close()


async def test_history_is_every_kept_revision_of_the_key_and_only_those(nats_url):
    bus = await busmod.connect(nats_url, "history-test")
    try:
        kv = await bus.kv("history-test", history=3)
        assert await bus.history(kv, "head", 100) == []
        revs = []
        for i in range(5):
            revs.append(await kv.put("head", f"v{i}".encode()))
            await kv.put("head-other", b"x")  # a key sharing the prefix, interleaved
        await kv.delete("head")
        gone = (await bus.js.stream_info(kv._stream)).state.last_seq
        kv.history = None  # never nats-py's watch
        want = [(revs[3], b"v3"), (revs[4], b"v4"), (gone, b"")]  # the bucket keeps three
        assert await bus.history(kv, "head", gone) == want
        assert await bus.history(kv, "head", revs[4]) == want[:2]
        assert await bus.history(kv, "head", revs[3] - 1) == []
    finally:
        await bus.close()


@pytest.mark.parametrize("jobs", [1, 30])
async def test_a_restarted_runner_resumes_its_running_jobs(nats_url, tmp_path, jobs):
    bus = await busmod.connect(nats_url, "runner-test")
    try:
        await bus.setup()
        kv = await bus.kv(JOBS_BUCKET)
        job = JobConfig(job_id="resume-me", preset="tiny", steps=3)
        for i in range(jobs):
            state = "running" if i == 0 else "done"
            await bus.kv_put(kv, f"job-{i}", JobRecord(job_id=f"job-{i}", job=job.model_dump_json(), state=state,
                                                       submitted_at=time.time(), runs=1))
        runner = Runner(bus, Stack(tmp_path), tmp_path, 1)
        runner_kv = bus.kv

        async def kv_with_a_failing_watch(bucket: str, **kwargs):  # noqa: ANN202
            got = await runner_kv(bucket, **kwargs)
            _empty_watch(got)
            return got

        bus.kv = kv_with_a_failing_watch
        await runner.open()
        assert sorted(runner.records) == sorted(f"job-{i}" for i in range(jobs))
        assert runner.records["job-0"].state == "queued"  # the job it ran is queued again: it resumes
        await runner.close()
    finally:
        await bus.close()
