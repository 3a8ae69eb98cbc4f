"""`use_threads`: a process multiplies with its `threads` setting in the threads it hands work to as well as on
its event loop (the worker's tiles, the PS's training step)."""

from __future__ import annotations

import asyncio

import torch

from cleave.runtime.threads import use_threads


def test_a_tile_rounds_the_same_on_the_loop_and_in_a_thread_with_the_workers_threads():
    """`use_threads(1)`: a tile handed to a thread multiplies with one thread, as the loop does. Without the
    executor's setting, OpenMP gives that thread every core, and on this machine a product with K = 1,024 then
    differs in its last bits from the loop's (a tile's bits would depend on whether it was small)."""
    before = torch.get_num_threads()
    torch.manual_seed(0)
    a, bt = torch.randn(64, 1024), torch.randn(128, 1024)

    async def both() -> tuple[torch.Tensor, torch.Tensor]:
        use_threads(1)
        return a @ bt.T, await asyncio.to_thread(lambda: a @ bt.T)

    try:
        on_loop, in_thread = asyncio.run(both())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(on_loop, in_thread)
