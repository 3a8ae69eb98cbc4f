"""How many threads a process multiplies with, in every thread it hands work to."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


def use_threads(threads: int) -> None:
    """Multiply with `threads` intra-op threads here and in every thread the running loop hands work to
    (`asyncio.to_thread`): torch's setting reaches OpenMP for the calling thread only, so a thread of the default
    executor would use every core, and a product there could round differently from the same product here."""
    import torch  # (the scheduler and the monitor never multiply, and start without torch)

    torch.set_num_threads(threads)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(initializer=torch.set_num_threads,
                                                                        initargs=(threads,)))
