"""`cleave swarm`, a load-testing tool: many real workers in one process, each with its own NATS connection,
heartbeats, block cache and torch tiles, sharing one event loop, one torch thread and one measurement.

`serve_swarm` runs the workers of one process until `stop`; `swarm_ids` names them. The `cleave swarm`
command (cleave_cli.swarm_cmd) spreads N workers over P such processes.
"""

from __future__ import annotations

import asyncio

import structlog

from cleave import auth
from cleave import bus as busmod
from cleave.runtime.threads import use_threads
from cleave_worker.core import measure_flops
from cleave_worker.device import first_profile
from cleave_worker.main import run_worker
from cleave_worker.settings import WorkerSettings

log = structlog.get_logger("swarm")
DEFAULT_PREFIX = "swarm"


def swarm_ids(prefix: str, process: int, count: int) -> list[str]:
    """The ids of process `process`'s `count` workers: `<prefix>-<process>-<i>`."""
    width = max(1, len(str(count - 1)))
    return [f"{prefix}-{process}-{i:0{width}d}" for i in range(count)]


async def serve_swarm(base: WorkerSettings, ids: list[str], stop: asyncio.Event) -> int:
    """Run one worker per id in this event loop until `stop`; every worker stops and closes its connection.

    FLOPS are measured once; links too (over one short-lived connection) unless `base.profile` declares a
    device, in which case every worker paces itself to it."""
    use_threads(base.threads)
    flops = measure_flops()
    shared = None if base.profile else await _links_once(base, ids[0], flops, stop)
    if not base.profile and shared is None:  # stopped before the links were measured
        return 0
    log.info("swarm_started", workers=len(ids), first=ids[0], last=ids[-1], declared=bool(base.profile))
    settings = [base.model_copy(update={"worker_id": w}) for w in ids]
    async with asyncio.TaskGroup() as tg:
        for s in settings:
            tg.create_task(run_worker(s, stop, flops, shared))
    log.info("swarm_stopped", workers=len(ids))
    return 0


async def _links_once(base: WorkerSettings, first_id: str, flops: float, stop: asyncio.Event):
    """This machine's profile, measured once for all its workers (None if stopped before it was)."""
    s = base.model_copy(update={"worker_id": first_id})
    bus = await busmod.connect(s.nats_url, f"cleave-worker-{first_id}-probe", stop=stop,
                               **auth.connect_options(s, "worker"))
    if bus is None:
        return None
    try:
        return await first_profile(s, bus, flops, stop)
    finally:
        await bus.close()
