"""Service lifecycle: signals set a stop event; a second Ctrl-C forces the exit (after uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from cleave.errors import EXIT_INTERRUPTED


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`; a second signal exits at once with status 130."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            os._exit(EXIT_INTERRUPTED)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)


def run(main: Callable[[asyncio.Event], Coroutine[Any, Any, int]]) -> int:
    """Run `main(stop)` in a fresh event loop with stop signals installed; returns its exit status."""

    async def runner() -> int:
        stop = asyncio.Event()
        install_stop_signals(stop)
        return await main(stop)

    return asyncio.run(runner())


async def wait_for_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to `timeout_s`, waking early when `stop` is set; returns whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout_s)
    return stop.is_set()
