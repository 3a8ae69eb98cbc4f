"""Where the events stream files an event or a step line, and which schema reads it back: the job in the subject
is what `cleave status --job-id` reads and `cleave forget` purges, so a job's events must land under its id, the
fleet's under none that a job id could be."""

from __future__ import annotations

import re

from cleave.schemas import (
    NO_JOB,
    SUBJECT_EVENTS_ALL,
    Event,
    StepMetrics,
    event_schema,
    event_subject,
    events_subject,
)
from cleave.schemas.jobs import JOB_ID_PATTERN


def test_a_jobs_events_are_filed_under_its_id_and_the_fleets_under_no_job_id() -> None:
    line = StepMetrics(job="tiny-1", step=3, loss=2.0, step_time_s=0.1, workers=2)
    done = Event(kind="job_done", at=1.0, job="tiny-1")
    joined = Event(kind="worker_joined", at=1.0, worker_id="w1")
    assert [event_subject(m) for m in (line, done, joined)] == [
        "cleave.events.metrics.tiny-1", "cleave.events.job_done.tiny-1", "cleave.events.worker_joined.~fleet"]
    assert not re.match(JOB_ID_PATTERN, NO_JOB)  # (a forget of any job can never purge the fleet's)
    assert events_subject(job="tiny-1") == "cleave.events.*.tiny-1"
    assert events_subject("metrics") == "cleave.events.metrics.*"
    assert all(event_subject(m).startswith(SUBJECT_EVENTS_ALL[:-1]) for m in (line, done, joined))


def test_the_schema_follows_the_kind_in_the_subject_new_and_old() -> None:
    assert event_schema("cleave.events.metrics.tiny-1") is StepMetrics
    assert event_schema("cleave.events.metrics") is StepMetrics  # (a hub's events stored by an earlier build)
    assert event_schema("cleave.events.job_done.metrics") is Event  # (a job named "metrics")
    assert event_schema("cleave.events.worker_joined.~fleet") is Event
