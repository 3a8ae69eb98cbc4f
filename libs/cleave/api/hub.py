"""A hub's jobs from anywhere that reaches its NATS: submit a job to its runner, cancel one, forget an ended one,
read the jobs' records and a job's step metrics (the events stream keeps them), follow a job to its end. `cleave
submit`, `cleave cancel`, `cleave forget` and `cleave status` are these with their printing; `from cleave import
submit, cancel, forget, status, follow` the same from Python.

Every call logs in with the submitter's credential found in an auth directory (`cleave auth init`'s, or the
submitter's copy of it: `submitter.env` and `tls/ca.pem`), or with none on a hub without auth.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, TypeVar

import nats.errors
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, BucketNotFoundError
from pydantic import Field

from cleave import bus as busmod
from cleave import codec
from cleave.api import contact
from cleave.api.args import JobId, Seconds, blocking, checked
from cleave.api.credentials import client_options
from cleave.bus import history, urls
from cleave.bus.limits import STORE_FAILED
from cleave.errors import CleaveError
from cleave.runtime import logs
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    JOBS_STREAM,
    METRICS_KIND,
    SUBJECT_JOB_SUBMIT,
    Event,
    JobRecord,
    JobSubmission,
    StepMetrics,
    event_subject,
    events_subject,
)
from cleave.schemas.base import Wire
from cleave.schemas.jobs import ENDED, runner_silent_s, waiting_for_workers
from cleave.schemas.subjects import kv_stream, kv_subject
from cleave.train.job import JobConfig

T = TypeVar("T", bound=Wire)
R = TypeVar("R")
DEFAULT_CONNECT_TIMEOUT_S = 15.0
DEFAULT_ASK_AFTER_S = 2.0  # a login not done by then is tried once more on its own, to say why (`contact`)
DEFAULT_WAIT_S = 30.0  # how long `submit` waits for the runner's verdict
DEFAULT_POLL_S = 0.25
DEFAULT_FOLLOW_S = 2.0  # how often `follow` reads a job's new steps
DEFAULT_RETRY_S = 1.0  # between tries to store a job on a hub whose runner has not made its stream yet


# ---- the hub's client -------------------------------------------------------------------------------
async def connect(url: str, folder: Path | None, role: str = "submitter") -> busmod.Bus:
    """Log in at `url` as `role` with the credential in `folder`; a clear error when that cannot be done."""
    logs.unless_configured()  # (the client's retries are not for a program's stdout)
    urls.servers(url)  # (a wrong URL named before the credential is read)
    options = client_options(folder, role)
    start = time.monotonic()
    slow = asyncio.Event()  # the usual case logs in once, at once; only a login this slow is asked why (below)
    timer = asyncio.get_running_loop().call_later(DEFAULT_ASK_AFTER_S, slow.set)
    try:
        bus = await busmod.connect(url, f"cleave-{role}", stop=slow, **options)
    except CleaveError:  # refused outright: the try below says why in a user's terms (the leaf port, the folder)
        bus = None
    finally:
        timer.cancel()
    if bus is not None:
        return bus
    first = await contact.first_try(url, options, folder, role)
    if first is not None and first.final:  # a certificate, a credential, the wrong port: no retry mends it
        raise CleaveError(f"NATS at {url}: {first.reason}")
    left = max(1.0, DEFAULT_CONNECT_TIMEOUT_S - (time.monotonic() - start))
    late = asyncio.Event()  # (a stop, not asyncio.wait_for: see cleave.bus.stopping)
    timer = asyncio.get_running_loop().call_later(left, late.set)
    try:
        bus = await busmod.connect(url, f"cleave-{role}", stop=late, **options)
    finally:
        timer.cancel()
    if bus is None:
        why = first.reason if first is not None else "check the URL, that the hub is up and the port open to you"
        raise CleaveError(f"could not reach NATS at {url} within {DEFAULT_CONNECT_TIMEOUT_S:.0f}s: {why}")
    return bus



def reachable(url: str, folder: Path | None, role: str) -> None:
    """Log in at `url` as `role` and out again: CleaveError (ConfigError for a wrong URL) when that cannot be
    done, before a process that would retry it for ever is started."""

    async def go() -> None:
        await (await connect(url, folder, role)).close()

    blocking(go())


async def store(bus: busmod.Bus, job_id: str, sub: JobSubmission, wait_s: float, url: str):  # noqa: ANN201 - a PubAck
    """Publish the submission into the hub's JetStream; until `wait_s` while its stream is not there yet (a hub
    whose runner is starting). The message id is the nonce: a try whose answer was lost is stored once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job=job_id), codec.encode(sub),
                                        timeout=busmod.DEFAULT_TIMEOUT_S, headers={"Nats-Msg-Id": sub.nonce})
        except APIError as e:
            if e.err_code == STORE_FAILED:  # the queue is full (its runner takes no jobs), or the job too large
                raise CleaveError(f"the hub at {url} refused to store job {job_id}: {e.description}") from None
            refused = e
        except Exception as e:  # no stream (yet): no runner has started on that hub
            refused = e
        if time.monotonic() > deadline:
            raise CleaveError(f"the hub at {url} did not take the job within {wait_s:.0f}s ({type(refused).__name__}): "
                              "is its runner up (`cleave up`, or compose's `runner`)?" + unanswered(refused))
        await asyncio.sleep(DEFAULT_RETRY_S)


async def verdict(bus: busmod.Bus, job_id: str, nonce: str, wait_s: float) -> JobRecord | None:
    """The job's record once it answers this submission (its nonce), or None after `wait_s`."""
    kv = None

    async def answered() -> JobRecord | None:
        nonlocal kv
        try:
            kv = kv or await asyncio.wait_for(bus.js.key_value(JOBS_BUCKET), busmod.DEFAULT_TIMEOUT_S)
            got = await bus.kv_get(kv, job_id, JobRecord)
        except Exception:  # the bucket is not there yet (no runner so far)
            return None
        return got[0] if got is not None and got[0].nonce == nonce else None

    return await polled(answered, wait_s)


async def polled(look: Callable[[], Awaitable[R | None]], wait_s: float) -> R | None:
    """What `look()` finds, asked every DEFAULT_POLL_S until it finds something; None after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (found := await look()) is not None:
            return found
        await asyncio.sleep(DEFAULT_POLL_S)
    return None



def unanswered(e: BaseException) -> str:
    """What a request the server never answered may mean: the server drops, without a reply, a request that the
    credential may not make (its -ERR goes to the connection's log)."""
    if not isinstance(e, TimeoutError | nats.errors.TimeoutError):
        return ""
    return (" The server did not answer, which is also how it treats a request this credential may not make: "
            "is --auth the submitter's folder (submitter.env, not a worker's or a site's)?")


async def read_records(bus: busmod.Bus, job_id: str | None) -> list[JobRecord]:
    try:
        kv = await asyncio.wait_for(bus.js.key_value(JOBS_BUCKET), busmod.DEFAULT_TIMEOUT_S)
    except BucketNotFoundError:
        return []  # no runner has ever run there
    except Exception as e:
        raise CleaveError(f"the hub's job records could not be read ({type(e).__name__})." + unanswered(e)) from None
    if job_id is not None:
        got = await bus.kv_get(kv, job_id, JobRecord)
        return [got[0]] if got else []
    # (one pass over the bucket's stream, each key's latest value: one request a key took 8-26 s for 10,000)
    found = await history.read(bus.js, kv_stream(JOBS_BUCKET), kv_subject(JOBS_BUCKET), JobRecord,
                               DeliverPolicy.LAST_PER_SUBJECT)
    return sorted(found, key=lambda r: r.submitted_at)


async def untaken(bus: busmod.Bus, job_id: str | None = None) -> list[str]:
    """The jobs (or only `job_id`) whose submission waits on the hub for a runner to take it (CLEAVE_JOBS is a
    work queue: what is still there is not taken); none where that cannot be read."""
    try:
        info = await bus.js.stream_info(JOBS_STREAM, subjects_filter=SUBJECT_JOB_SUBMIT.format(job=job_id or "*"))
    except Exception:  # noqa: BLE001 - no stream (no submission ever), or the server does not answer
        return []
    return sorted(subject.rsplit(".", 1)[-1] for subject in info.state.subjects or {})


async def read_metrics(bus: busmod.Bus, job_id: str) -> list[StepMetrics]:
    """The job's step lines from the events stream, in step order, each step once (its last line: a PS that
    resumed reports the lines of its last commit again)."""
    by_step = {sm.step: sm for sm in (await read_new_metrics(bus, job_id))[0]}
    return [by_step[s] for s in sorted(by_step)]


async def read_new_metrics(bus: busmod.Bus, job_id: str, after: int = 0) -> tuple[list[StepMetrics], int]:
    """The job's step lines the events stream holds past sequence number `after`, as told, and the sequence
    number to read past next time (`after` when there are none): `follow` reads each line once."""
    found = await history.numbered(bus.js, EVENTS_STREAM, events_subject(METRICS_KIND, job_id), StepMetrics,
                                   DeliverPolicy.ALL, after)
    return [sm for _, sm in found], max((seq for seq, _ in found), default=after)


async def read_lasts(bus: busmod.Bus, job_id: str | None = None) -> dict[str, tuple[StepMetrics, int]]:
    """Each job's (or only `job_id`'s) last step line and how many step lines the events stream holds of it, in
    two requests however many there are (each job's lines are filed under its id: the stream counts them)."""
    lasts = await _events(bus, METRICS_KIND, StepMetrics, job_id)
    if not lasts:
        return {}
    subject = events_subject(METRICS_KIND, job_id or "*")
    counts = (await bus.js.stream_info(EVENTS_STREAM, subjects_filter=subject)).state.subjects or {}
    return {sm.job: (sm, counts.get(event_subject(sm), 1)) for sm in lasts}


async def read_waits(bus: busmod.Bus, job_id: str | None = None) -> dict[str, Event]:
    """Each job's (or only `job_id`'s) latest word from its PS that it has no worker to deal to (the
    `waiting_for_workers` events; `summary` judges whether it still holds)."""
    return {e.job: e for e in await _events(bus, "waiting_for_workers", Event, job_id)}


async def read_trims(bus: busmod.Bus, job_id: str | None = None) -> dict[str, Event]:
    """Each job's (or only `job_id`'s) word from its PS that a round's trimmed mean dropped nothing (too few
    updates for its trim: the plain mean was applied; the `trimmed_drops_nothing` events, the latest)."""
    return {e.job: e for e in await _events(bus, "trimmed_drops_nothing", Event, job_id)}


async def _events(bus: busmod.Bus, kind: str, schema: type[T], job_id: str | None) -> list[T]:
    """The events stream's latest message of one kind of each job, or of `job_id` (a job's events are filed
    under its id; one that does not decode is skipped)."""
    return await history.read(bus.js, EVENTS_STREAM, events_subject(kind, job_id or "*"), schema,
                              DeliverPolicy.LAST_PER_SUBJECT)


def description(rec: JobRecord) -> dict:
    """A record's job description; {} for one that is no JSON object (an older runner kept a refused
    submission's text as it came, and `cleave status` ended on it for every user)."""
    try:
        job = json.loads(rec.job)
    except ValueError:
        return {}
    return job if isinstance(job, dict) else {}


def summary(rec: JobRecord, progress: tuple[StepMetrics, int] | None = None, now: float | None = None,
            wait: Event | None = None, trim: Event | None = None) -> dict:
    """A job as `cleave status --json` shows it; `progress`: its last step line and how many the hub holds of it
    (`read_lasts`), None before its first step. `runner_silent_s`: for a queued or running job whose runner has
    not stamped its record for RUNNER_SILENT_S, how long (its runner is gone: it goes on once one is back).
    `waiting_for_workers`: its PS has no worker to deal to (`wait`, its latest word of that, while it holds:
    since when, at which step, how many workers it expelled as faulty), else None. `trimmed_drops_nothing`: a
    round (`round`) whose trimmed mean dropped nothing, with its `updates` and `trim` (`trim`, its PS's word:
    the plain mean was applied), else None."""
    job = description(rec)
    steps = job.get("steps")
    last, reported = progress or (None, 0)
    now = time.time() if now is None else now
    return {"job": rec.job_id, "state": rec.state, "done": rec.state == "done", "steps": steps,
            "runner_silent_s": runner_silent_s(rec.state, rec.heard_at, now),
            "waiting_for_workers": waiting_for_workers(rec.state, wait, last.at if last else None, rec.started_at, now),
            "trimmed_drops_nothing": ({"round": trim.step, "updates": trim.detail.get("updates"),
                                       "trim": trim.detail.get("trim")} if trim is not None else None),
            "method": job.get("method", "cleave"),
            "step": last.step if last else None, "steps_reported": reported,
            "loss": last.loss if last else None, "workers": last.workers if last else None,
            "submitted_at": rec.submitted_at, "started_at": rec.started_at, "ended_at": rec.ended_at,
            "runs": rec.runs, "exit_code": rec.exit_code, "reason": rec.reason,
            "last_submission": {"verdict": rec.verdict, "reason": rec.verdict_reason}}


# ---- the Python API ------------------------------------------------------------------------------------
@checked
def submit(job: JobConfig, nats: str, auth: str | Path | None = None, min_workers: Annotated[int, Field(ge=0)] = 0,
           wait_s: Annotated[float, Field(ge=0)] = DEFAULT_WAIT_S,
           on_stored: Callable[[], None] | None = None) -> JobRecord | None:
    """Submit `job` to the hub at `nats`; returns the runner's record of it once it answers this submission
    (its state: queued, running, ...), None when no runner answered within `wait_s` (the job waits on the hub).
    A job the runner refuses raises CleaveError with its reason. `on_stored` is called once the hub has stored
    the submission (from then on the job runs whatever happens to this call)."""

    async def go() -> JobRecord | None:
        sub = JobSubmission(job=job.model_dump_json(), nonce=secrets.token_hex(8), submitted_at=time.time(),
                            min_workers=min_workers)
        bus = await connect(nats, _path(auth))
        try:
            await store(bus, job.job_id, sub, wait_s, nats)
            if on_stored is not None:
                on_stored()
            rec = await verdict(bus, job.job_id, sub.nonce, wait_s)
        finally:
            await bus.close()
        if rec is not None and rec.verdict == "refused":
            raise CleaveError(f"the hub refused job {job.job_id}: {rec.verdict_reason}")
        return rec

    return blocking(go())


async def cancel_on(bus: busmod.Bus, job_id: str, nats: str,
                    wait_s: float) -> tuple[JobRecord | None, JobRecord | None]:
    """Send a cancel of `job_id` and wait up to `wait_s` for the runner's answer: its record before (None for a
    job only submitted, not taken yet) and the record that answers the cancel (None: no answer in time)."""
    before = await read_records(bus, job_id)
    if not before and not await untaken(bus, job_id):
        raise CleaveError(f"the hub at {nats} knows no job {job_id!r} (`cleave status` lists them)")
    sub = JobSubmission(job="{}", nonce=secrets.token_hex(8), submitted_at=time.time(), action="cancel")
    await store(bus, job_id, sub, wait_s, nats)
    rec = await verdict(bus, job_id, sub.nonce, wait_s)
    if rec is not None and rec.verdict == "refused":  # (a runner of a Cleave without cancels judged it a job)
        raise CleaveError(f"the hub's runner did not cancel job {job_id}: {rec.verdict_reason} (is the hub's "
                          "Cleave older than this one?)")
    return (before[0] if before else None), rec


@checked
def cancel(job_id: JobId, nats: str, auth: str | Path | None = None,
           wait_s: Annotated[float, Field(ge=0)] = DEFAULT_WAIT_S) -> JobRecord | None:
    """Cancel the job `job_id` on the hub at `nats`: a queued job does not start, a running one's PS commits its
    step and stops. Its checkpoint stays: submitting the job again resumes it. Returns the runner's record once
    it answers (state `cancelled`, or the state a job that had ended kept), None when no runner answered within
    `wait_s` (the cancel waits on the hub). CleaveError when the hub knows no such job."""

    async def go(bus: busmod.Bus) -> JobRecord | None:
        return (await cancel_on(bus, job_id, nats, wait_s))[1]

    return _on_hub(nats, auth, go)


async def forget_on(bus: busmod.Bus, job_id: str, nats: str, wait_s: float) -> bool:
    """Send a forget of `job_id` and wait up to `wait_s` for the runner to have deleted its record: True once it
    has, False when no runner answered in time (the forget waits on the hub). CleaveError when the hub knows no
    such job, or its runner refused (a job that has not ended is not forgotten)."""
    if not await read_records(bus, job_id):
        waits = " (it waits to be taken: forget it once it has ended)" if await untaken(bus, job_id) else ""
        raise CleaveError(f"the hub at {nats} has no record of job {job_id!r}{waits} (`cleave status` lists them)")
    sub = JobSubmission(job="{}", nonce=secrets.token_hex(8), submitted_at=time.time(), action="forget")
    await store(bus, job_id, sub, wait_s, nats)

    async def forgotten() -> bool | None:
        records = await read_records(bus, job_id)
        if records and records[0].nonce == sub.nonce:  # (answered, and the record stays: refused)
            raise CleaveError(f"the hub's runner did not forget job {job_id}: {records[0].verdict_reason}")
        return True if not records else None

    return await polled(forgotten, wait_s) or False


@checked
def forget(job_id: JobId, nats: str, auth: str | Path | None = None,
           wait_s: Annotated[float, Field(ge=0)] = DEFAULT_WAIT_S) -> bool:
    """Forget the ended job `job_id` on the hub at `nats`: its runner deletes its checkpoints, state, step lines,
    files and record, for good. True once it has, False when no runner answered within `wait_s` (the forget waits
    on the hub). CleaveError when the hub has no record of the job, or the job has not ended (cancel it first)."""

    return _on_hub(nats, auth, lambda bus: forget_on(bus, job_id, nats, wait_s))


@checked
def status(nats: str, auth: str | Path | None = None, job_id: JobId | None = None) -> list[dict]:
    """The hub's jobs (or the one named), each as `cleave status --json` shows it: state, step, loss, workers, and
    whether its PS waits for workers."""

    async def go(bus: busmod.Bus) -> list[dict]:
        records = await read_records(bus, job_id)
        lasts = await read_lasts(bus, job_id) if records else {}
        waits = await read_waits(bus, job_id) if records else {}
        trims = await read_trims(bus, job_id) if records else {}
        return [summary(rec, lasts.get(rec.job_id), wait=waits.get(rec.job_id), trim=trims.get(rec.job_id))
                for rec in records]

    return _on_hub(nats, auth, go)


@checked
def follow(job_id: JobId, nats: str, auth: str | Path | None = None, poll_s: Seconds = DEFAULT_FOLLOW_S,
           timeout_s: Seconds | None = None) -> Iterator[dict]:
    """Each step's metrics of a job on the hub as they are committed, until the job is done (or failed: then
    CleaveError with its reason, after the steps it committed)."""
    urls.servers(nats)  # (named at the call, not at the first step asked for)
    return _follow(job_id, nats, auth, poll_s, timeout_s)


def _follow(job_id: str, nats: str, auth: str | Path | None, poll_s: float,
            timeout_s: float | None) -> Iterator[dict]:
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    read_past = 0  # the events stream's sequence number of the last line read: each poll reads what came since

    async def read(bus: busmod.Bus) -> tuple[JobRecord | None, list[StepMetrics]]:
        nonlocal read_past
        records = await read_records(bus, job_id)
        lines, read_past = await read_new_metrics(bus, job_id, read_past)
        return (records[0] if records else None), sorted(lines, key=lambda m: m.step)

    while True:
        rec, lines = _on_hub(nats, auth, read)
        for m in lines:
            if m.step not in seen:
                seen.add(m.step)
                yield m.model_dump(exclude={"job"})
        if rec is None:
            raise CleaveError(f"the hub at {nats} knows no job {job_id!r}")
        if rec.state in ENDED:
            if rec.state == "failed":
                raise CleaveError(f"job {job_id} failed: {rec.reason or 'see the runner log on the hub'}")
            if rec.state == "cancelled":
                raise CleaveError(f"job {job_id} was {rec.reason or 'cancelled'}")
            return
        if deadline is not None and time.monotonic() > deadline:
            raise CleaveError(f"job {job_id} did not end within {timeout_s}s (it is {rec.state})")
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


def _path(auth: str | Path | None) -> Path | None:
    return Path(auth) if auth is not None else None


def _on_hub(nats: str, auth: str | Path | None, work: Callable[[busmod.Bus], Awaitable[R]]) -> R:
    """`work` done on a connection to the hub at `nats` (logged in from `auth`), closed after."""

    async def go() -> R:
        bus = await connect(nats, _path(auth))
        try:
            return await work(bus)
        finally:
            await bus.close()

    return blocking(go())
