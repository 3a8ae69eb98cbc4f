"""A wait that a stop cuts short (`cleave.bus.stopping`) ends even when the work loses its first cancellation,
as nats-py's first connect does when Python 3.11's `asyncio.wait_for` returns a result that came in the same
turn as the cancellation: the login then retried for ever and its caller waited 300 s (a TLS handshake with
another deployment's CA, refused every 0.5 s)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from cleave.bus.stopping import cancelled, done_unless_stopped


async def retrying_for_ever(lost: list[int], losses: int) -> None:
    """A connect that retries until it is cancelled, the first `losses` cancellations lost."""
    while True:
        try:
            await asyncio.sleep(0.01)  # (a handshake that fails)
        except asyncio.CancelledError:
            if len(lost) < losses:
                lost.append(1)  # swallowed: the loop goes on, as wait_for's result did
                continue
            raise


async def test_a_stop_ends_work_that_lost_its_first_cancellations() -> None:
    lost: list[int] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    waiting = asyncio.ensure_future(done_unless_stopped(retrying_for_ever(lost, 2), stop))
    await asyncio.wait({waiting}, timeout=5)
    if not waiting.done():
        await cancelled(waiting)
        pytest.fail("the stopped wait still waited after 5 s")
    assert waiting.result() is False and lost == [1, 1]  # cancelled three times: two lost, the third ended it


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancellation from 3.12 on")
async def test_wait_for_loses_a_cancellation_when_its_result_comes_in_the_same_turn() -> None:
    """The loss itself, as nats-py's connect meets it: `wait_for` around something that is done when the cancel
    lands returns its result instead of raising."""
    ended: list[str] = []

    async def connect_once() -> None:
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(fut.set_result, "handshake failed")
        try:
            await asyncio.wait_for(fut, 10)
        finally:
            ended.append("returned" if fut.done() else "cancelled")

    task = asyncio.ensure_future(connect_once())
    await asyncio.sleep(0)  # (it waits inside wait_for now; the future is set on the next turn)
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    assert not task.cancelled() and ended == ["returned"]  # the cancellation is gone


async def test_cancelled_drops_any_outcome() -> None:
    async def failing() -> None:
        raise ValueError("not for the caller")

    task = asyncio.ensure_future(failing())
    await asyncio.sleep(0)
    await cancelled(task)  # (already ended with an error: nothing raised)
    assert task.done()
