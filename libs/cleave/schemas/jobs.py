"""Jobs submitted from anywhere to the hub's runner: the submission, and the record the runner keeps of each job.

`cleave submit` publishes a `JobSubmission` on `cleave.jobs.submit.<job>` (JetStream stream CLEAVE_JOBS: stored
on the hub until the runner takes it). The runner answers in the KV bucket `cleave-jobs`, key `<job>`, with a
`JobRecord`: the job's state and the verdict on the latest submission (named by its nonce), which `cleave submit`
and `cleave status` read. Only the runner writes that bucket. `cleave cancel` publishes on the same subject a
submission whose `action` is "cancel": the runner stops that job (its PS commits and exits; its checkpoint stays,
so submitting it again resumes it) and records it `cancelled`. `cleave forget` publishes one whose `action` is
"forget": the runner deletes an ended job's checkpoint, state, step lines and files, and its record last.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from cleave.schemas.base import Wire
from cleave.schemas.limits import MAX_JOB_BYTES, MAX_REASON_CHARS
from cleave.schemas.state import Event
from cleave.schemas.subjects import TOKEN_CHARS

JOB_STATES = ("queued", "running", "done", "failed", "cancelled")  # a job's life on the hub, in order
ENDED = ("done", "failed", "cancelled")  # nothing more happens to a job in these until it is submitted again
JOB_ID_PATTERN = rf"^[{TOKEN_CHARS}]{{1,64}}$"  # as JobConfig.job_id: one subject token, one KV key
NONCE_PATTERN = r"^[0-9a-f]{16,64}$"
MAX_MIN_WORKERS = 100_000
RUNNER_REFRESH_S = 30.0  # the runner stamps its queued and running jobs' records this often (`heard_at`)
RUNNER_SILENT_S = 180.0  # a record of a queued or running job unstamped this long: its runner is gone
WAIT_EVENT_S = 60.0  # a PS with no worker to deal to says so (a `waiting_for_workers` event) this often
# a moment in seconds since the epoch (finite: `cleave status` and the dashboard show it as a date, and the
# queue is ordered by it); 1e10 is the year 2286
Time = Annotated[float, Field(ge=0, le=1e10, allow_inf_nan=False)]


class JobSubmission(Wire):
    """One job for the hub: its description as `cleave submit` built it (the runner validates it again)."""

    job: str = Field(max_length=MAX_JOB_BYTES)  # the JobConfig as JSON ("{}" for a cancel or a forget)
    nonce: str = Field(pattern=NONCE_PATTERN)  # names this submission: the runner's verdict carries it back
    # the submitter's clock, as it says: the runner orders its queue by when it took the job; a number, strictly
    # (true or "1700000000" was read as a time)
    submitted_at: Annotated[Time, Field(strict=True)]
    min_workers: int = Field(0, ge=0, le=MAX_MIN_WORKERS)  # start once this many workers are registered (or later)
    # run this job (queue it), cancel the job of that id, or forget it (an ended job: its record and state go)
    action: Literal["run", "cancel", "forget"] = "run"


class JobRecord(Wire):
    """What the hub's runner knows of one job: its state, its description and how its last submission went."""

    job_id: str = Field(pattern=JOB_ID_PATTERN)
    job: str = Field(max_length=MAX_JOB_BYTES)  # the JobConfig (JSON) it runs, or last ran
    state: Literal[JOB_STATES]  # type: ignore[valid-type]
    submitted_at: Time  # when the runner took its latest submission (by the runner's clock)
    min_workers: int = Field(0, ge=0, le=MAX_MIN_WORKERS)
    started_at: Time | None = None  # when its PS was last started
    ended_at: Time | None = None
    exit_code: int | None = None  # of its PS, once done or failed
    reason: str = Field("", max_length=MAX_REASON_CHARS)  # why it failed (in the words of the PS's error), or was cancelled
    runs: int = Field(0, ge=0)  # PS processes started for it (restarts and resumes included)
    nonce: str = ""  # the latest submission's nonce, accepted or refused
    verdict: Literal["accepted", "refused"] = "accepted"
    verdict_reason: str = Field("", max_length=MAX_REASON_CHARS)  # why that submission was refused
    heard_at: Time | None = None  # when the runner last wrote it (every RUNNER_REFRESH_S while queued or running)


def runner_silent_s(state: str, heard_at: float | None, now: float) -> int | None:
    """How long the runner of a queued or running job has not stamped its record, once that is past
    RUNNER_SILENT_S (its runner is gone: the job goes on once one is back); None otherwise."""
    quiet = now - heard_at if heard_at is not None else 0.0
    return round(quiet) if state in ("queued", "running") and quiet > RUNNER_SILENT_S else None


def waiting_for_workers(state: str, wait: Event | None, last_step_at: float | None, started_at: float | None,
                        now: float) -> dict | None:
    """What the PS of a running job last said of its wait for workers (its latest `waiting_for_workers` event):
    since when it has had none to deal to, at which step, and how many it expelled as faulty; while that is its
    latest word (no step reported since, and said by the PS started last) and fresh (said within 3 x
    WAIT_EVENT_S: it says it again every WAIT_EVENT_S while the wait lasts). None otherwise."""
    heard = max(last_step_at or 0.0, started_at or 0.0)
    if state != "running" or wait is None or wait.at <= heard or now - wait.at > 3 * WAIT_EVENT_S:
        return None
    return {"since": wait.detail.get("since") or wait.at, "step": wait.step, "faulty": wait.detail.get("faulty") or 0}
