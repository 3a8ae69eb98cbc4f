"""The PS's pool of GEMM outputs (`cleave_ps.fleet.products`): a buffer is handed out again only once nothing
holds its memory (no tensor, view, numpy array, storage object or tensor autograd saved), and the pool keeps
at most its cap."""

from __future__ import annotations

import pytest
import torch

from cleave.runtime.memory import MAPPED_BYTES
from cleave_ps.fleet.products import Products

M, N = 512, 512  # 1 MiB of float32: the smallest output the pool keeps


def test_a_freed_output_is_handed_out_again_and_a_small_or_pinned_one_never() -> None:
    pool = Products(cap=8 * MAPPED_BYTES)
    out, fresh = pool.take(M, N, torch.float32)
    assert fresh and out.nbytes == MAPPED_BYTES
    ptr = out.data_ptr()
    del out
    again, fresh = pool.take(M, N, torch.float32)
    assert not fresh and again.data_ptr() == ptr and again.shape == (M, N)
    other, fresh = pool.take(M // 2, N * 2, torch.float32)  # another shape: a buffer of its own
    assert fresh and other.data_ptr() != ptr
    half, fresh = pool.take(M, 2 * N, torch.bfloat16)  # another dtype too
    assert fresh and half.data_ptr() not in (ptr, other.data_ptr())
    small, fresh = pool.take(M, N // 2, torch.float32)
    assert fresh and pool.held == 3 * MAPPED_BYTES  # the small one (half a MiB) is not kept
    assert (pool.reused, pool.fresh) == (1, 3)


def hold(out: torch.Tensor, holder: str, w: torch.Tensor) -> object:
    return {"the output": lambda: out, "a view": lambda: out.view(-1), "a slice": lambda: out[1:],
            "a numpy array": lambda: out.numpy(), "a memoryview": lambda: memoryview(out.numpy()),
            "its storage": lambda: out.untyped_storage(), "autograd": lambda: (out * w).sum()}[holder]()


@pytest.mark.parametrize("holder", ["the output", "a view", "a slice", "a numpy array", "a memoryview",
                                    "its storage", "autograd"])
def test_memory_something_still_holds_is_never_handed_out(holder: str) -> None:
    pool = Products(cap=8 * MAPPED_BYTES)
    out, _ = pool.take(M, N, torch.float32)
    ptr = out.zero_().data_ptr()
    w = torch.ones(N, requires_grad=True)
    keep = hold(out, holder, w)
    del out
    held, fresh = pool.take(M, N, torch.float32)
    assert fresh and held.data_ptr() != ptr  # a new buffer: the first is still held
    held.fill_(7.0)
    if holder == "autograd":  # the saved output is still intact: the gradient reads it
        keep.backward()
        assert torch.equal(w.grad, torch.zeros(N))  # (7 * M had the buffer been handed out again)
    del keep, held
    _, fresh = pool.take(M, N, torch.float32)
    assert not fresh  # released: reused
    assert (pool.reused, pool.fresh) == (1, 2)


def test_the_pool_keeps_at_most_its_cap_and_makes_room_with_free_buffers() -> None:
    pool = Products(cap=3 * MAPPED_BYTES)
    a, _ = pool.take(M, N, torch.float32)
    b, _ = pool.take(M, 2 * N, torch.float32)  # 2 MiB: 3 MiB held
    c, fresh = pool.take(M, N // 2 * 3, torch.float32)  # 1.5 MiB: no room, and nothing free to drop
    assert fresh and pool.held == 3 * MAPPED_BYTES
    del a  # free now: dropped (the least recently used free buffer) to make room for a new shape
    d, fresh = pool.take(2 * M, N // 2, torch.float32)
    assert fresh and pool.held == 3 * MAPPED_BYTES and [x.shape for x in pool.buffers] == [(M, 2 * N), (2 * M, N // 2)]
    big, fresh = pool.take(4 * M, N, torch.float32)  # over the cap: never kept
    assert fresh and pool.held == 3 * MAPPED_BYTES
    assert b.shape == (M, 2 * N) and c.shape == (M, 768) and d.shape == (2 * M, N // 2) and big.shape == (4 * M, N)


def test_no_cap_keeps_nothing_and_a_pinned_output_comes_from_torch() -> None:
    pool = Products(cap=0)
    out, fresh = pool.take(M, N, torch.float32)
    assert fresh and pool.held == 0
    if torch.cuda.is_available():
        pinned, fresh = Products(cap=8 * MAPPED_BYTES).take(M, N, torch.float32, pin=True)
        assert fresh and pinned.is_pinned()
