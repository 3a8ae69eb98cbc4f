"""Telling the planned workers their fan-out groups (`cleave.gemm.fanout`): each worker subscribes to the
subjects its groups' shared blocks are published on and confirms (`FanoutJoin` / `FanoutAck`); only those that
confirm are sent shared blocks that way, the others get them with their tiles."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from cleave.bus import Bus
from cleave.gemm import fanout
from cleave.gemm.dealer import Dealer
from cleave.schemas import SUBJECT_CONTROL, SUBJECT_FANOUT, FanoutAck, FanoutJoin, Plan

log = structlog.get_logger("ps")
DEFAULT_JOIN_TIMEOUT_S = 2.0  # a worker that does not confirm its fan-out groups by then gets blocks direct
DEFAULT_JOIN_CONCURRENCY = 64


class JoinShell(Protocol):
    """What telling the groups needs of the dispatcher."""

    bus: Bus
    dealer: Dealer
    job_id: str
    epoch: int
    _sent_bytes: int
    _last_join: dict[str, list[str]]

    def _tiling(self, m: int, n: int, k: int, b: int) -> tuple: ...


async def join_groups(d: JoinShell, plan: Plan) -> None:
    """Tell each planned worker the fan-out groups of `plan`; the dealer learns who joined which."""
    cut = [d._tiling(g.m, g.n, g.k, d._sent_bytes)[:2] for g in plan.gemms]
    groups = fanout.memberships(cut, plan.chunks)
    gate = asyncio.Semaphore(DEFAULT_JOIN_CONCURRENCY)

    async def join(worker: str) -> None:
        names = sorted(groups.get(worker, ()))
        if d._last_join.get(worker) == names:
            return
        subjects = tuple(SUBJECT_FANOUT.format(job=d.job_id, epoch=d.epoch, group=g) for g in names)
        async with gate:
            try:
                ack = await d.bus.request(SUBJECT_CONTROL.format(worker_id=worker), FanoutJoin(
                    job=d.job_id, epoch=d.epoch, version=plan.version, subjects=subjects),
                    FanoutAck, timeout_s=DEFAULT_JOIN_TIMEOUT_S)
            except Exception as e:  # an old worker, or one that is gone: blocks go with its tiles
                log.info("fanout_not_joined", worker_id=worker, error=repr(e)[:200])
                return
        if ack.error:
            log.warning("fanout_not_joined", worker_id=worker, error=ack.error[:200])
            return
        joined = {s.rsplit(".", 1)[1] for s in ack.joined}
        d.dealer.join(worker, joined & set(names))
        d._last_join[worker] = names

    await asyncio.gather(*(join(w) for w in list(d.dealer.members)))
