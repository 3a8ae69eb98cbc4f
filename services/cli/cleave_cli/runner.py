"""The hub's PS job runner (`cleave runner`; `cleave up` and compose's hub start it): jobs submitted to JetStream
from anywhere run here, one at a time unless the operator allows more (`--max-running`).

- Taking a job: a durable consumer of the stream CLEAVE_JOBS hands over each submission once. The runner checks
  it (a valid job description; a tokenizer and data its PS can read here, `jobs.check_inputs`; a job that is running
  is not replaced; a job that has state keeps its model and data order, `cleave_ps.state.persist.identity_changes`;
  room in the queue), writes its verdict into the job's record (KV bucket `cleave-jobs`, key: the job id) and
  only then acknowledges it, so no submission is lost between the two.
- The queue is that bucket: `queued` jobs start in the order they were submitted, each once `min_workers`
  workers are registered (or after JOIN_WAIT_S); at most `--max-queued` wait at once (CLEAVE_RUNNER_MAX_QUEUED).
  A runner that starts again finds `queued` and `running` jobs there and runs them; each PS resumes from its
  last commit, as the job id names its state.
- Supervision, as `cleave up` supervises its processes: a PS that dies is started again (and resumes); one that
  exits with a status of NOT_RESTARTED stays down: 0 with every step committed is `done`, anything else
  `failed`, with the PS's error as the reason, as is one in a crash loop (cleave.api.stack). One that exits 0
  short of its last step (stopped from outside) is started again.
- Cancelling (`cleave cancel`: a submission whose action is "cancel", on the job's subject): a queued job is
  recorded `cancelled` and does not start; a running one too, and its PS is sent SIGTERM (it commits its step and
  exits; its exit status goes into the record). Its checkpoint stays: submitting it again resumes it, once its PS
  has exited (until then it counts as running). A job that had ended keeps its state.
- Forgetting (`cleave forget`, action "forget"): an ended job's checkpoints, state, events, files and record
  are deleted (`cleave_cli.forget`); a job that is queued or running, or whose PS still stops, is not forgotten
  (the verdict says why).
- On the hub's disk: `<run-dir>/jobs/<job>/job.json` and `metrics.jsonl` (appended over the job's runs),
  `<run-dir>/logs/ps-<job>.log`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from pathlib import Path

import nats
import nats.js.errors
import structlog
from nats.js.api import ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from cleave import bus as busmod
from cleave import codec
from cleave.api.hub import read_records
from cleave.api.stack import CRASH_LOOP_STARTS, CRASH_WINDOW_S, Proc, Stack
from cleave.bus.limits import JOBS_MAX_BYTES, STORE_FAILED
from cleave.errors import CreateRefused, WireError
from cleave.schemas import (
    JOBS_BUCKET,
    JOBS_STREAM,
    MAX_CONTROL_BYTES,
    MAX_JOB_BYTES,
    MAX_REASON_CHARS,
    REGISTRY_BUCKET,
    STATE_BUCKET,
    SUBJECT_JOB_SUBMIT_ALL,
    JobRecord,
    JobSubmission,
    StateHead,
)
from cleave.schemas.jobs import ENDED, JOB_ID_PATTERN, RUNNER_REFRESH_S
from cleave.schemas.subjects import TOKEN_CHARS, kv_stream
from cleave.train.identity import refusal
from cleave.train.job import JobConfig
from cleave_cli import forget

log = structlog.get_logger("runner")
DEFAULT_MAX_RUNNING = 1  # jobs at once: several PSs share one fleet, so one unless the operator says otherwise
# jobs waiting at once: a submission beyond it is refused (a flood of jobs grew the runner and its bucket without
# bound); a job is a few KiB, and a sweep of hundreds fits
DEFAULT_MAX_QUEUED = 1000
MAX_QUEUED_ENV = "CLEAVE_RUNNER_MAX_QUEUED"  # --max-queued's default, for compose (its .env reaches the runner)
# records of refused new jobs kept (their verdicts, for `cleave submit` and `status`); past it the oldest goes: a
# flood of invalid jobs, each on a new id, filled the records' bucket, and with it full the runner stopped
DEFAULT_MAX_REFUSED = 10_000
INPUTS_TIMEOUT_S = 30.0  # checking a job's tokenizer and data (`jobs.check_inputs`) longer than this refuses it
DEFAULT_TICK_S = 0.5  # how often submissions are taken and the PS processes looked after
JOIN_WAIT_S = 60.0  # a job waits at most this long for its `min_workers`, then starts with those there
CONSUMER = "runner"  # the durable consumer of CLEAVE_JOBS
ACK_WAIT_S = 60.0  # a submission not acknowledged within this (the runner died) is handed over again
MAX_DELIVER = 5  # at most this often: one that ended the runner every time is dropped, not taken for ever
RECORD_ROOM = MAX_JOB_BYTES + 2 * MAX_REASON_CHARS  # the largest record: its job's description and two reasons
RECORDS_FULL_HINT = (f"the job records' bucket {kv_stream(JOBS_BUCKET)} is full: new submissions wait on the hub "
                     "until it has room (the jobs it has go on): `cleave forget` jobs that ended, or raise its limit")


class Runner:
    def __init__(self, bus: busmod.Bus, stack: Stack, run_dir: Path, max_running: int,
                 max_queued: int = DEFAULT_MAX_QUEUED, max_refused: int = DEFAULT_MAX_REFUSED,
                 ack_wait_s: float = ACK_WAIT_S) -> None:
        self.bus, self.stack, self.run_dir, self.max_running = bus, stack, run_dir, max_running
        self.max_queued, self.max_refused, self.ack_wait_s = max_queued, max_refused, ack_wait_s
        self.full = False  # the records' bucket had no room for a new record: no submission is taken until it has
        self.refused: dict[str, None] = {}  # the refused new jobs whose records are kept, oldest first
        self.records: dict[str, JobRecord] = {}  # this runner writes them: its copy is the bucket's
        self.waiting: dict[str, float] = {}  # job -> since when it waits for its workers
        self.restarts: dict[str, int] = {}  # job -> restarts of its PS already counted in its record's runs
        self.sub = None  # the pull subscription to submissions (`open`)

    async def close(self) -> None:
        """Leave the submissions' pull subscription before the bus drains: the answers to a fetch that timed
        out wait in its queue unread, and a drain waits for them until its timeout (5 s of every stop)."""
        if self.sub is not None:
            with contextlib.suppress(Exception):  # (the bus may be away: closing it ends the subscription too)
                await self.sub.unsubscribe()

    async def open(self) -> None:
        await jobs_stream(self.bus)
        self.kv = await self.bus.kv(JOBS_BUCKET)
        self.state = await self.bus.kv(STATE_BUCKET, history=5)
        self.registry = await self.bus.kv(REGISTRY_BUCKET, ttl_s=busmod.DEFAULT_REGISTRY_TTL_S)
        for rec in await read_records(self.bus, None):  # (in submission order)
            if rec.state == "running":  # the runner that ran it is gone: it runs again, and resumes
                rec = await self.put(rec.model_copy(update={"state": "queued"}))
            self.records[rec.job_id] = rec
            if (rec.state, rec.runs, rec.verdict) == ("failed", 0, "refused"):  # (never ran: refused when new)
                self.refused[rec.job_id] = None
        self.sub = await asyncio.wait_for(self.bus.js.pull_subscribe(
            SUBJECT_JOB_SUBMIT_ALL, durable=CONSUMER, stream=JOBS_STREAM,
            config=ConsumerConfig(ack_wait=self.ack_wait_s, max_deliver=MAX_DELIVER)), busmod.DEFAULT_TIMEOUT_S)

    async def put(self, rec: JobRecord) -> JobRecord:
        """Write `rec`, stamped: a reader sees from `heard_at` that this runner is alive (`vouch`)."""
        rec = rec.model_copy(update={"heard_at": time.time()})
        await self.bus.kv_put(self.kv, rec.job_id, rec)
        self.records[rec.job_id] = rec
        return rec

    # ---- submissions ---------------------------------------------------------------------------------
    async def take(self) -> None:
        """Judge the submissions waiting in CLEAVE_JOBS, recording each verdict before acknowledging it. None is
        taken while the records' bucket is full: each one handed over counts towards MAX_DELIVER, and one that
        could not be recorded (not acknowledged) is handed over again once there is room."""
        if self.full:
            if not await self.room():
                return
            self.full = False
            log.info("job_records_room_again", bucket=JOBS_BUCKET)
        try:
            msgs = await self.sub.fetch(8, timeout=DEFAULT_TICK_S)
        except TimeoutError:
            return
        for m in msgs:
            job_id = m.subject.rsplit(".", 1)[-1]
            try:
                sub = codec.decode(m.data, JobSubmission, MAX_CONTROL_BYTES)
            except WireError as e:  # nothing to answer: the submitter's nonce is in what could not be read
                log.warning("submission_rejected", job=job_id[:64], reason=e.reason, detail=str(e)[:200])
            else:
                try:
                    await self.judged(job_id, sub, m.metadata.timestamp.timestamp())
                except nats.js.errors.APIError as e:
                    self.full = e.err_code == STORE_FAILED  # (the one bucket it adds to)
                    raise
            await m.ack()

    async def room(self) -> bool:
        """Whether the records' bucket has room for one more record (its job's description and the rest)."""
        info = await asyncio.wait_for(self.bus.js.stream_info(kv_stream(JOBS_BUCKET)), busmod.DEFAULT_TIMEOUT_S)
        return info.config.max_bytes < 0 or info.state.bytes + RECORD_ROOM <= info.config.max_bytes

    async def judged(self, job_id: str, sub: JobSubmission, stored_at: float) -> None:
        """`accept`, for a submission on the subject of `job_id`: one whose id can name no record is logged,
        and one whose judging fails for any reason but the bus is logged too: the runner, and the jobs it runs,
        go on (a submission that ended it was handed to each runner that came back)."""
        if not re.fullmatch(JOB_ID_PATTERN, job_id):
            log.warning("submission_rejected", job=job_id[:64], reason="bad_job_id",
                        detail=f"a job id is 1 to 64 of [{TOKEN_CHARS}]")
            return
        try:  # (queued in the order the hub stored them, whatever clock the submitter claims)
            await self.accept(job_id, sub, stored_at)
        except (nats.errors.Error, TimeoutError, ConnectionError, CreateRefused):
            raise  # the bus is away: not acknowledged, handed over again
        except Exception as e:
            log.error("submission_unjudged", job=job_id, error=repr(e)[:300])

    async def accept(self, job_id: str, sub: JobSubmission, stored_at: float | None = None) -> JobRecord:
        """Judge `sub` (stored by the hub at `stored_at`, now by default) and record the verdict."""
        stored_at = time.time() if stored_at is None else stored_at
        old = self.records.get(job_id)
        if old is not None and old.nonce == sub.nonce:  # handed over again (its acknowledgement was lost): judged
            return old
        if sub.action == "cancel":
            return await self.cancel(job_id, sub, old)
        if sub.action == "forget":
            return await self.forget(job_id, sub, old)
        job, why = await self.judge(job_id, sub, old)
        if why:
            log.warning("job_refused", job=job_id, reason=why)
            verdict = {"nonce": sub.nonce, "verdict": "refused", "verdict_reason": why[:MAX_REASON_CHARS]}
            if old is not None:
                return await self.put(old.model_copy(update=verdict))
            # (a new job's record keeps no description: what was refused is the submitter's text, which every
            # reader of the bucket parses, and each such record stays in the runner's memory and its bucket)
            rec = await self.put(JobRecord(job_id=job_id, job="{}", state="failed", submitted_at=stored_at,
                                           reason=why[:MAX_REASON_CHARS], **verdict))
            self.refused[job_id] = None
            await self.forget_refused()
            return rec
        self.refused.pop(job_id, None)
        log.info("job_accepted", job=job_id, min_workers=sub.min_workers, again=old is not None)
        return await self.put(JobRecord(job_id=job_id, job=job.model_dump_json(), state="queued",
                                        submitted_at=stored_at, min_workers=sub.min_workers,
                                        runs=old.runs if old else 0, nonce=sub.nonce, verdict="accepted"))

    async def cancel(self, job_id: str, sub: JobSubmission, old: JobRecord | None) -> JobRecord | None:
        """Record job `job_id` cancelled, answering `sub`, and stop its PS if it runs (SIGTERM: it commits its step
        and exits); one that had ended keeps its state. None for a job without a record (nothing to cancel)."""
        if old is None:
            log.warning("cancel_ignored", job=job_id, reason="the runner has no record of this job")
            return None
        answered = {"nonce": sub.nonce, "verdict": "accepted", "verdict_reason": ""}
        if old.state in ENDED:
            return await self.put(old.model_copy(update=answered))
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        rec = await self.put(old.model_copy(update={"state": "cancelled", "ended_at": time.time(),
                                                    "reason": f"cancelled by its submitter at {when}", **answered}))
        self.waiting.pop(job_id, None)
        if old.state == "running" and self.alive(job_id):
            self.stack.kill(_ps_name(job_id), signal.SIGTERM, restart=False)
        log.info("job_cancelled", job=job_id, was=old.state)
        return rec

    async def forget(self, job_id: str, sub: JobSubmission, old: JobRecord | None) -> JobRecord | None:
        """Delete everything the hub holds of job `job_id`, answering `sub`, once it has ended (None: forgotten, or
        no record to forget); the record of a job that has not ended answers with the reason it stays."""
        if old is None:
            log.warning("forget_ignored", job=job_id, reason="the runner has no record of this job")
            return None
        if old.state not in ENDED or self.alive(job_id):
            why = (f"job {job_id!r} is {old.state}: cancel it first (`cleave cancel`)" if old.state not in ENDED
                   else f"job {job_id!r} was cancelled and its PS is still stopping; forget it in a moment")
            return await self.put(old.model_copy(update={"nonce": sub.nonce, "verdict": "refused",
                                                         "verdict_reason": why}))
        gone = await forget.forget(self.bus, job_id, self.run_dir / "jobs" / job_id,
                                   self.stack.log_path(_ps_name(job_id)))
        for held in (self.records, self.refused, self.restarts, self.waiting):
            held.pop(job_id, None)
        self.stack.procs.pop(_ps_name(job_id), None)
        log.info("job_forgotten", job=job_id, checkpoint_objects=gone.checkpoints, events=gone.events,
                 paths=[str(p) for p in gone.paths])
        return None

    def alive(self, job_id: str) -> bool:
        """Whether a PS of job `job_id` runs (a cancelled job's drains until it has committed)."""
        proc = self.stack.procs.get(_ps_name(job_id))
        return proc is not None and proc.running()

    async def forget_refused(self) -> None:
        """Remove the oldest records of refused new jobs past `max_refused`, every revision (no marker left)."""
        while len(self.refused) > self.max_refused:
            job_id = next(iter(self.refused))
            await forget.purge(self.bus, JOBS_BUCKET, job_id)
            del self.refused[job_id]
            self.records.pop(job_id, None)

    async def judge(self, job_id: str, sub: JobSubmission, old: JobRecord | None) -> tuple[JobConfig | None, str]:
        """The job, or why this submission is refused."""
        queued = sum(r.state == "queued" for r in self.records.values())
        if queued >= self.max_queued and (old is None or old.state != "queued"):  # (one queued is replaced)
            return None, (f"the hub's queue is full: {queued} jobs wait, its limit (cleave runner --max-queued, "
                          f"{MAX_QUEUED_ENV}); submit it again once some have started")
        try:
            job = JobConfig.build(**json.loads(sub.job))
        except Exception as e:  # (whatever a hostile description makes the checks raise: JSON nested too deep
            # raises RecursionError, a path may raise OSError; the runner and the jobs it runs go on)
            return None, f"not a valid job: {str(e)[:1000] or type(e).__name__}"
        if job.job_id != job_id:
            return None, f"the job names itself {job.job_id!r} but was submitted as {job_id!r}"
        if old is not None and old.state == "running":
            return None, f"job {job_id!r} is running; submit it again once it has ended (`cleave status`)"
        if old is not None and self.alive(job_id):
            return None, f"job {job_id!r} was cancelled and its PS is still stopping; submit it again in a moment"
        got = await self.bus.kv_get(self.state, f"{job_id}.head", StateHead)
        if got and (refused := refusal(job_id, got[0].job_config, got[0].step, job.model_dump_json())):
            return None, str(refused)
        try:  # (off the loop: a tokenizer is read whole)
            await asyncio.wait_for(asyncio.to_thread(check_inputs, job), INPUTS_TIMEOUT_S)
        except TimeoutError:
            return None, f"its tokenizer and data could not be checked within {INPUTS_TIMEOUT_S:.0f} s"
        except Exception as e:  # (ConfigError names the setting; anything else a hostile path raises, too)
            return None, str(e)[:1000] or type(e).__name__
        return job, ""

    # ---- the queue and the PS processes --------------------------------------------------------------
    async def vouch(self) -> None:
        """Stamp the records of the jobs still queued or running every RUNNER_REFRESH_S: `cleave status` tells a
        job whose runner is gone (its record unstamped for RUNNER_SILENT_S) from one that is merely slow."""
        now = time.time()
        for rec in [r for r in self.records.values() if r.state in ("queued", "running")]:
            if now - (rec.heard_at or 0.0) >= RUNNER_REFRESH_S:
                await self.put(rec)

    async def tick(self) -> None:
        await self.vouch()
        for proc in self.stack.supervise():  # the PSs that ended for good (NOT_RESTARTED) or were held down
            await self.ended(proc)
        for rec in [r for r in self.records.values() if r.state == "running"]:
            proc = self.stack.procs.get(_ps_name(rec.job_id))
            seen = self.restarts.get(rec.job_id, 0)
            if proc is not None and proc.restarts > seen:  # restarted since: say so in its record
                self.restarts[rec.job_id] = proc.restarts
                await self.put(rec.model_copy(update={"runs": rec.runs + proc.restarts - seen}))
        running = sum(r.state == "running" or (r.state == "cancelled" and self.alive(r.job_id))
                      for r in self.records.values())
        queued = sorted((r for r in self.records.values() if r.state == "queued"), key=lambda r: r.submitted_at)
        for rec in queued[: max(0, self.max_running - running)]:
            if not await self.workers_ready(rec):
                break  # first come, first served: the next job waits behind it
            await self.start(rec)

    async def workers_ready(self, rec: JobRecord) -> bool:
        registered = len(await self.bus.keys(self.registry))
        if rec.min_workers <= registered:
            return True
        if rec.job_id not in self.waiting:  # (said in its record: `cleave status` showed no reason to wait)
            self.waiting[rec.job_id] = time.monotonic()
            by = time.strftime("%H:%M:%S", time.localtime(time.time() + JOIN_WAIT_S))
            await self.put(rec.model_copy(update={"reason": f"waiting for {rec.min_workers} workers ({registered} "
                                                            f"registered): it starts with those there by {by}"}))
        if time.monotonic() - self.waiting[rec.job_id] < JOIN_WAIT_S:
            return False
        log.info("job_starts_without_its_workers", job=rec.job_id, min_workers=rec.min_workers, waited_s=JOIN_WAIT_S)
        return True

    async def start(self, rec: JobRecord) -> None:
        folder = self.run_dir / "jobs" / rec.job_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "job.json").write_text(json.dumps(json.loads(rec.job), indent=2))
        self.waiting.pop(rec.job_id, None)
        self.restarts[rec.job_id] = 0  # a new process: its restarts count from 0
        self.stack.service(_ps_name(rec.job_id), "ps", ["--job", str(folder / "job.json"),
                                                        "--metrics-out", str(folder / "metrics.jsonl")])
        log.info("job_started", job=rec.job_id, run=rec.runs + 1)
        await self.put(rec.model_copy(update={"state": "running", "started_at": time.time(), "ended_at": None,
                                              "exit_code": None, "reason": "", "runs": rec.runs + 1}))

    async def ended(self, proc: Proc) -> None:
        job_id = proc.name.removeprefix("ps-")
        rec, code = self.records.get(job_id), proc.popen.returncode
        if rec is not None and rec.state == "cancelled" and rec.exit_code is None:  # its PS, stopped: how it ended
            await self.put(rec.model_copy(update={"exit_code": code}))
        if rec is None or rec.state != "running":
            return
        if code == 0:
            got = await self.bus.kv_get(self.state, f"{job_id}.head", StateHead)
            if not JobConfig.build(**json.loads(rec.job)).finished_at(got[0].step if got else None):  # (stopped
                # from outside, not finished: it goes on)
                log.warning("job_restarted", job=job_id, reason="its PS stopped before the last step")
                self.stack.restart(proc.name)
                return
        state, reason = ("done", "") if code == 0 else ("failed", failure_reason(self.stack, proc))
        (log.info if code == 0 else log.warning)(f"job_{state}", job=job_id, exit_code=code, reason=reason)
        await self.put(rec.model_copy(update={"state": state, "ended_at": time.time(), "exit_code": code,
                                              "reason": reason[:MAX_REASON_CHARS]}))


async def jobs_stream(bus: busmod.Bus) -> None:
    """CLEAVE_JOBS: each submission kept on the hub until the runner has recorded it (a work queue, at most
    JOBS_MAX_BYTES: full, it refuses a submission, whose submitter is told, instead of dropping one)."""
    await bus.stream(StreamConfig(name=JOBS_STREAM, subjects=[SUBJECT_JOB_SUBMIT_ALL],
                                  retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                                  max_bytes=JOBS_MAX_BYTES, discard=DiscardPolicy.NEW,
                                  max_msg_size=MAX_CONTROL_BYTES, num_replicas=bus.replicas))


def check_inputs(job: JobConfig) -> None:
    """`cleave.api.jobs.check_inputs`, imported on first use in the thread that checks (it imports torch, which
    `cleave --help` does without, and which would hold the runner's loop for seconds)."""
    from cleave.api import jobs  # noqa: PLC0415

    jobs.check_inputs(job)


def failure_reason(stack: Stack, proc: Proc) -> str:
    """Why a PS failed, in its own words (`Stack.last_words`), else where to look; a crash loop (one left down
    after CRASH_LOOP_STARTS quick failures in a row) says so first."""
    last = stack.last_words(proc)
    why = f"its PS exited with {proc.popen.returncode}" + (f": {last}" if last else f"; see {stack.log_path(proc.name)}")
    if proc.crashes >= CRASH_LOOP_STARTS:
        why = (f"its PS failed {proc.crashes} times in a row, each within {CRASH_WINDOW_S:.0f} s of its start, and "
               f"is not started again; {why.removeprefix('its PS ')}")
    return why


def _ps_name(job_id: str) -> str:
    return f"ps-{job_id}"

