"""Waiting for something that a stop request may cut short: a first connection to a NATS that does not answer
(nats-py retries inside `connect`), or the pause before the next try.

A cancellation can be lost: before Python 3.12, `asyncio.wait_for` returns its result instead of raising when
what it awaits finishes in the same turn as the cancellation (bpo-42130), and nats-py's first `connect` (which
retries for ever) awaits its socket and TLS handshake that way. A login refused by a certificate, cancelled
while its next handshake failed, then went on retrying, and whoever waited for the cancelled connect waited for
ever (seen: 300 s, 542 handshakes). So a stopped wait asks again (`cancelled`) until the work has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

RECANCEL_S = 0.5  # a cancelled task not ended by then is cancelled again


async def done_unless_stopped(aw: Awaitable, stop: asyncio.Event | None) -> bool:
    """Await `aw` unless `stop` is set first (`aw` is then cancelled, and waited for until it has ended);
    whether `aw` finished. Its exception, if it raised one, is raised here."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        await task
        return True
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task.done():
        task.result()
        return True
    await cancelled(task)
    return False


async def cancelled(task: asyncio.Future, again_s: float = RECANCEL_S) -> None:
    """Cancel `task` and wait until it has ended, cancelling it again every `again_s` while it goes on (its
    outcome, whatever it is, is dropped)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_s)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
