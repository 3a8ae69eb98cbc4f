"""What a job reports and keeps: events, the per-step metrics line, and the streamed checkpoint's manifest and head."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cleave.schemas.base import TensorData, Wire
from cleave.schemas.dtypes import DTYPES
from cleave.schemas.subjects import NO_JOB, SUBJECT_EVENTS, token

MAX_EPSILON = 1e4  # the DP accountant's upper end (`cleave.methods.privacy`): a run past it reports this bound


class Event(Wire):
    """Something that happened: a worker joined or left, a recovery, a plan change, a PS restart."""

    kind: str  # snake_case past tense: worker_joined, worker_lost, recovered, ps_resumed, ...
    at: float
    job: str = ""
    step: int | None = None
    worker_id: str | None = None
    cause: str = ""
    detect_s: float | None = None
    redispatch_s: float | None = None
    complete_s: float | None = None
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


class StepMetrics(Wire):
    """One line of `--metrics-out` and of the monitor's loss curve."""

    job: str = ""
    method: str = "cleave"
    step: int
    loss: float
    step_time_s: float
    workers: int
    tiles: int = 0
    tiles_resent: int = 0
    tiles_copied: int = 0  # speculative copies sent (a straggler's or a silent worker's tiles redone elsewhere)
    tiles_dropped: int = 0  # late or duplicate results
    rejected: int = 0  # malformed or invalid results
    bytes_down: int = 0  # PS -> workers (what leaves the PS)
    bytes_down_per_worker: int = 0  # what each worker receives (a broadcast round: the same message for all)
    bytes_up: int = 0  # workers -> PS
    tokens: int = 0
    lr: float = 0.0
    val_loss: float | None = None
    recoveries: int = 0
    gemm_s: float = 0.0  # of step_time_s, the wall time of the distributed GEMMs; the rest is the PS's own work
    predicted_gemm_s: float | None = None  # the plan's makespans of this step's GEMMs (None: not all planned)
    predicted_step_s: float | None = None  # predicted_gemm_s + the PS's own time in its previous steps
    raw_bytes_up: int = 0  # what the workers' updates weighed before compression (data-parallel methods)
    updates: int = 0  # updates applied this round (data-parallel methods)
    updates_dropped: int = 0  # late, duplicate or invalid updates
    updates_late: int = 0  # of `updates`, late ones folded in (within max_staleness, weight 1/(1+age))
    applied: bool = True  # False: the round closed under min_updates and the global weights stayed
    dp_epsilon: float | None = None  # client-level DP: the epsilon spent up to this round (at the job's dp_delta)
    recovery: tuple[Event, ...] = ()  # each recovery in this step: cause, detection, re-dispatch, completion
    resumed: bool = False  # this step ran on a PS that had restarted from persisted state
    checkpoint_s: float = 0.0  # seconds spent after this step streaming the state to JetStream (0: not due)
    replica_wait_s: float = 0.0  # PS replicas: waiting for the slowest replica's backward (a barrier)
    allreduce_s: float = 0.0  # PS replicas: the gradient all-reduce itself
    peak_rss_bytes: int = 0  # the PS's (or the reference's) peak resident memory so far (0: not measured)
    verify_cpu_s: float = 0.0  # the PS's CPU seconds in Freivalds' check of this step's result blocks
    at: float = 0.0


METRICS_KIND = "metrics"  # the events stream's kind for step lines; an Event is filed under its own kind


def event_kind(msg: Event | StepMetrics) -> str:
    """The kind the events stream files `msg` under (`SUBJECT_EVENTS`)."""
    return METRICS_KIND if isinstance(msg, StepMetrics) else msg.kind


def event_subject(msg: Event | StepMetrics) -> str:
    """Where the events stream files `msg`: under its kind and the job it names (`NO_JOB` when none)."""
    return events_subject(event_kind(msg), token(msg.job) if msg.job else NO_JOB)


def events_subject(kind: str = "*", job: str = "*") -> str:
    """The events stream's subject of `kind` and `job` (either a wildcard, "*", by default: every kind of one
    job, one kind of every job)."""
    return SUBJECT_EVENTS.format(kind=kind, job=job)


def event_schema(subject: str) -> type[Event] | type[StepMetrics]:
    """The schema of the events stream's message on `subject` (`SUBJECT_EVENTS`: its kind first)."""
    kind = subject.removeprefix(SUBJECT_EVENTS.split("{", 1)[0]).split(".", 1)[0]
    return StepMetrics if kind == METRICS_KIND else Event


class TensorEntry(Wire):
    """One tensor of a streamed checkpoint: its bytes follow the previous entry's in the data object."""

    key: str = Field(max_length=256)  # "model.<key>" or "opt.<param index>.<name>"
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[int, ...] = Field(max_length=8)


class CheckpointManifest(Wire):
    """The PS's state after a committed step (data position = step + 1): the tensors' raw bytes stream in
    `data_object`, in the order of `tensors`, hashed every `chunk_bytes` bytes; RNG and optimizer groups here."""

    job: str
    step: int
    epoch: int
    created_at: float
    data_object: str
    size: int = Field(ge=0)  # bytes in data_object
    chunk_bytes: int = Field(gt=0)
    chunk_sha256: tuple[str, ...] = Field(max_length=1 << 20)
    tensors: tuple[TensorEntry, ...] = Field(max_length=1 << 20)
    optimizer_groups: list[dict[str, Any]]
    rng: TensorData


class StateHead(Wire):
    """The small KV record naming the last committed checkpoint; updated by compare-and-set, last."""

    job: str
    step: int  # last committed step
    epoch: int
    object: str  # the CheckpointManifest's object
    sha256: str  # of the manifest object
    size: int  # of the checkpoint's data object
    job_config: str  # the JSON job description the state belongs to
    metrics: tuple[StepMetrics, ...] = ()  # the steps this commit made durable (their --metrics-out lines)
