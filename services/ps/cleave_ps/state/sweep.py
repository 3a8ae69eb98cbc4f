"""What a PS killed in the middle of a checkpoint leaves in the Object Store, removed after a later commit.

Two kinds of garbage: a checkpoint of this job that no kept head names (written completely, but the PS died
before switching the head to it; or committed by an earlier incarnation of the PS and since superseded),
deleted by name; and the chunks of a put that never finished (the PS died while streaming: nats-py writes
an object's chunks under `$O.<bucket>.C.<nuid>` and its name only at the end, so nothing names them),
purged by subject. The bucket is shared by every job, so a nameless chunk subject is purged only when its
last chunk is older than `min_age_s`: a put in progress writes one every few milliseconds.

`erase` deletes every checkpoint of a job that is forgotten (`cleave forget`), with the markers of the deletions.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
from dataclasses import dataclass

import structlog
from nats.js.errors import NotFoundError

from cleave.bus import DEFAULT_TIMEOUT_S, Bus
from cleave.schemas.subjects import obj_stream

log = structlog.get_logger("ps")
DEFAULT_ORPHAN_AGE_S = 60.0  # a nameless chunk subject this much older than its last chunk is garbage


@dataclass
class Collected:
    deleted: tuple[str, ...] = ()  # objects of this job no kept head names
    purged: tuple[str, ...] = ()  # chunk subjects of puts that never finished


async def _objects(store) -> list:  # noqa: ANN001 - nats-py's ObjectStore
    try:
        return await asyncio.wait_for(store.list(ignore_deletes=True), DEFAULT_TIMEOUT_S)
    except NotFoundError:  # an empty bucket
        return []


async def _nameless(bus: Bus, bucket: str, named: set[str], min_age_s: float) -> list[str]:
    """Chunk subjects that no object names and that got no chunk for `min_age_s`."""
    stream = obj_stream(bucket)
    info = await asyncio.wait_for(bus.js.stream_info(stream, subjects_filter=f"$O.{bucket}.C.>"), DEFAULT_TIMEOUT_S)
    now = datetime.datetime.now(datetime.UTC)
    old = []
    for subject in sorted((info.state.subjects or {}).keys()):
        if subject.rsplit(".", 1)[1] in named:
            continue
        last = await asyncio.wait_for(bus.js.get_last_msg(stream, subject), DEFAULT_TIMEOUT_S)
        if last.time is not None and (now - last.time).total_seconds() > min_age_s:
            old.append(subject)
    return old


async def collect(bus: Bus, store, bucket: str, job_id: str, keep: set[str],  # noqa: ANN001
                  min_age_s: float = DEFAULT_ORPHAN_AGE_S) -> Collected:
    """Delete this job's checkpoints outside `keep` (names of manifests; each has a `.data`), then purge
    nameless chunk subjects older than `min_age_s`. Best effort: a failure is logged, never raised."""
    deleted, purged = [], []
    try:
        objects = await _objects(store)
        deleted = await _delete(store, objects, job_id, keep)
        named = {info.nuid for info in objects if info.nuid}
        for subject in await _nameless(bus, bucket, named, min_age_s):
            await asyncio.wait_for(bus.js.purge_stream(obj_stream(bucket), subject=subject), DEFAULT_TIMEOUT_S)
            purged.append(subject)
    except Exception as e:  # the next commit tries again
        log.warning("checkpoint_garbage_not_collected", job=job_id, error=repr(e)[:300])
    if deleted or purged:
        log.info("checkpoint_garbage_collected", job=job_id, deleted=len(deleted), purged=len(purged))
    return Collected(tuple(deleted), tuple(purged))


async def erase(bus: Bus, store, bucket: str, job_id: str) -> list[str]:  # noqa: ANN001 - nats-py's ObjectStore
    """Delete every checkpoint of job `job_id` (the job is forgotten), and the marker each deletion leaves under
    the object's name; the names deleted. Raises where one could not be deleted (forgetting the job stops there,
    and is tried again)."""
    deleted = await _delete(store, await _objects(store), job_id, set())
    for name in deleted:
        meta = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        await asyncio.wait_for(bus.js.purge_stream(obj_stream(bucket), subject=meta), DEFAULT_TIMEOUT_S)
    return deleted


async def _delete(store, objects: list, job_id: str, keep: set[str]) -> list[str]:  # noqa: ANN001
    deleted = []
    for info in objects:
        if info.name.startswith(f"{job_id}/") and info.name.removesuffix(".data") not in keep:
            await asyncio.wait_for(store.delete(info.name), DEFAULT_TIMEOUT_S)
            deleted.append(info.name)
    return deleted
