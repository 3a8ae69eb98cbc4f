"""What the hub's runner deletes when it forgets an ended job (`cleave forget`): everything the hub holds of it.

In this order, so that a runner stopped halfway still has the job's record, and the forget (handed to it again,
as it was not acknowledged) finishes: the job's checkpoints in the Object Store (`cleave_ps.state.sweep.erase`),
its state's head (`<job>.head`, every revision), every event that names it (its step lines and its PS's words,
filed under its id: one purge; the fleet's events name no job and stay), its folder and PS log in the run dir, and
last its record (every revision, leaving the KV's purge marker: a dashboard watching the records drops the job at
once). Its fencing epoch (`<job>.epoch`, one counter) stays: a PS of the forgotten job still running somewhere can
never commit over a new job of the same id, whose PS claims a higher epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from cleave import bus as busmod
from cleave.schemas import EVENTS_STREAM, JOBS_BUCKET, STATE_BUCKET, STATE_OBJECTS, events_subject
from cleave.schemas.subjects import kv_stream, kv_subject, stream_purge
from cleave_ps.state import sweep


@dataclass(frozen=True)
class Forgotten:
    checkpoints: int  # objects deleted (a checkpoint is two)
    events: int  # events deleted
    paths: tuple[Path, ...]  # files and folders deleted in the run dir


async def forget(bus: busmod.Bus, job_id: str, folder: Path, log: Path) -> Forgotten:
    """Delete everything the hub holds of job `job_id` (`folder`: its files, `log`: its PS's log), its record
    last. Raises where something could not be deleted: the record stays, and forgetting the job again finishes."""
    try:
        store = await asyncio.wait_for(bus.js.object_store(STATE_OBJECTS), busmod.DEFAULT_TIMEOUT_S)
    except BucketNotFoundError:  # no PS has ever committed on this hub
        objects = []
    else:
        objects = await sweep.erase(bus, store, STATE_OBJECTS, job_id)
    await purge(bus, STATE_BUCKET, f"{job_id}.head")
    events = await purge_events(bus, job_id)
    paths = tuple(p for p in (folder, log) if p.exists())
    for path in paths:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    jobs = await asyncio.wait_for(bus.js.key_value(JOBS_BUCKET), busmod.DEFAULT_TIMEOUT_S)
    await asyncio.wait_for(jobs.purge(job_id), busmod.DEFAULT_TIMEOUT_S)  # (its marker tells a dashboard)
    return Forgotten(len(objects), events, paths)


async def purge(bus: busmod.Bus, bucket: str, key: str) -> None:
    """Remove `key` from KV bucket `bucket` with every revision (no deletion marker is left)."""
    await purge_subject(bus, kv_stream(bucket), kv_subject(bucket, key))


async def purge_events(bus: busmod.Bus, job_id: str) -> int:
    """Delete every event that names job `job_id` from the events stream in one request: how many there were
    (none where there is no events stream: no stack ever ran on this hub)."""
    with contextlib.suppress(NotFoundError):
        return await purge_subject(bus, EVENTS_STREAM, events_subject(job=job_id))
    return 0


async def purge_subject(bus: busmod.Bus, stream: str, subject: str) -> int:
    """Delete every message of `stream` on `subject` (a wildcard too): how many there were. nats-py's
    `purge_stream` drops that count, so the JetStream request is made here; its error raised as nats-py's."""
    ask = json.dumps({"filter": subject}).encode()
    said = json.loads((await bus.nc.request(stream_purge(stream), ask, timeout=busmod.DEFAULT_TIMEOUT_S)).data)
    if "error" in said:
        APIError.from_error(said["error"])  # (raises)
    return said["purged"]
