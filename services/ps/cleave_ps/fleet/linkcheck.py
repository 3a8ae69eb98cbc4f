"""Proving a returning worker's downlink before it is dealt tiles: the shell of the dealer's rule
(`ProveLink` / `Dealer.proved`).

A worker that left the plan and came back, or a suspect whose retry time came, (its link was cut, its process restarted) has heartbeats on a
connection of their own, which may recover long before the connection its tiles travel on: after a cut,
nats-server's TCP connection to it can sit in retransmit back-off for seconds, with tiles from before the
cut still queued. So the PS sends it a small request (`LinkCheck`, CHECK_BYTES) on its tile
connection, behind whatever is still queued there, and deals it tiles only once the answer is back. The
check names when it was sent: the worker drops the tiles sent before it (given back when it left) rather
than spend its compute and uplink on results nobody waits for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

import structlog

from cleave.bus import Bus
from cleave.gemm.dealer import CHECK_BYTES, Dealer, Instruction
from cleave.schemas import SUBJECT_LINKCHECK, DeviceProfile, LinkCheck, LinkCheckAck

log = structlog.get_logger("ps")
DEFAULT_CHECK_TIMEOUT_S = 2.0  # at least; longer on a slow declared or measured downlink
DEFAULT_CHECK_RETRY_S = 0.5  # between a failed check and the next


class Shell(Protocol):
    """What a link check needs of the dispatcher: its bus, its dealer and clock, and a way to send what the
    dealer deals once the link is proven."""

    bus: Bus
    dealer: Dealer
    job_id: str
    epoch: int
    stopping: bool

    def clock(self) -> float: ...

    async def post(self, instructions: Sequence[Instruction]) -> None: ...


def check_timeout(profile: DeviceProfile | None) -> float:
    """How long one check may take: 4x what its bytes and round trip cost on the worker's link, >= 2 s."""
    if profile is None:
        return DEFAULT_CHECK_TIMEOUT_S
    return max(DEFAULT_CHECK_TIMEOUT_S, 4 * (CHECK_BYTES / profile.downlink_bytes_per_s + 2 * profile.latency_s))


async def prove(d: Shell, worker: str) -> None:
    """Check `worker`'s link until it answers (then deal it tiles), it leaves, or the PS stops."""
    tries = 0
    while not d.stopping:
        m = d.dealer.members.get(worker)
        if m is None or m.proven:
            return
        tries += 1
        started = d.clock()
        msg = LinkCheck(job=d.job_id, epoch=d.epoch, sent_at=time.time(), payload=bytes(CHECK_BYTES))
        try:
            await d.bus.request(SUBJECT_LINKCHECK.format(worker_id=worker), msg, LinkCheckAck,
                                timeout_s=check_timeout(m.profile))
        except Exception as e:  # no answer yet: its connection is still backing off, or it is gone again
            log.info("link_not_proven", worker_id=worker, tries=tries, error=repr(e)[:200])
            await asyncio.sleep(DEFAULT_CHECK_RETRY_S)
            continue
        log.info("link_proven", worker_id=worker, tries=tries, round_trip_s=round(d.clock() - started, 4))
        await d.post(d.dealer.proved(worker, d.clock()))
        return
