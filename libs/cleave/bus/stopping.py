"""Waiting for something that a stop request may cut short: a first connection to a NATS that does not answer
(nats-py retries inside `connect`), or the pause before the next try."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable


async def done_unless_stopped(aw: Awaitable, stop: asyncio.Event | None) -> bool:
    """Await `aw` unless `stop` is set first (`aw` is then cancelled); whether `aw` finished. Its exception,
    if it raised one, is raised here."""
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
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False
