"""Freivalds' check of result blocks (`cleave_ps.fleet.freivalds`): honest blocks, however their worker summed
them and whatever the job's precision, stay far below the tolerance; lies of any size that matters are caught;
and the check costs a small fraction of the tile's own product."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cleave import codec
from cleave_ps.fleet import freivalds

SHAPES = [(16, 16, 64), (64, 48, 512), (128, 64, 4096)]


def inputs(kind: str, r: int, c: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "gauss":
        return torch.randn(r, k, generator=g), torch.randn(c, k, generator=g)
    if kind == "positive":  # every partial sum grows: the worst case for a sequential sum
        return torch.rand(r, k, generator=g), torch.rand(c, k, generator=g)
    if kind == "offset":  # large values of one sign
        return 1000 + torch.rand(r, k, generator=g), 1 + torch.rand(c, k, generator=g)
    a = torch.randn(r, k, generator=g)
    a[:, :3] *= 1000  # outlier features, as in large language models
    return a, 0.02 * torch.randn(c, k, generator=g)


def sequential(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """The product summed one k at a time in float32: the largest rounding an honest worker can have."""
    out = torch.zeros(a.shape[0], bt.shape[0])
    for k in range(a.shape[1]):
        out += torch.outer(a[:, k], bt[:, k])
    return out


def verdict(a: torch.Tensor, bt: torch.Tensor, block: torch.Tensor) -> freivalds.Verdict:
    dtype = codec.dtype_name(block.dtype)
    raw = (block.view(torch.int16) if block.dtype == torch.bfloat16 else block).numpy()
    return freivalds.check(freivalds.Norms(a, bt), 0, a.shape[0], 0, bt.shape[0], freivalds.block_float32(raw, dtype),
                           dtype)


@pytest.mark.parametrize("kind", ["gauss", "positive", "offset", "outliers"])
@pytest.mark.parametrize("shape", SHAPES)
def test_honest_blocks_pass_far_below_the_tolerance(kind: str, shape: tuple[int, int, int]) -> None:
    r, c, k = shape
    a, bt = inputs(kind, r, c, k, torch.Generator().manual_seed(r + k))
    blocks = {"blas": a @ bt.T, "bf16": (a @ bt.T).bfloat16()}
    if k <= 512:
        blocks["sequential"] = sequential(a, bt)
    if kind != "offset":  # (its products overflow float16: such a block is refused as not finite)
        blocks["fp16"] = (a @ bt.T).half()
    for how, block in blocks.items():
        worst = max(verdict(a, bt, block).worst for _ in range(5))  # a fresh random vector each time
        # measured over 20,000 fresh vectors: at most 0.27 (half-precision rounding of positive sums, k = 4,096;
        # 0.19 typical), 0.04 (float32 sums); the check refuses at 1.0
        assert worst < 0.4, (how, worst)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_wrong_element_is_caught_and_named(shape: tuple[int, int, int]) -> None:
    r, c, k = shape
    a, bt = inputs("gauss", r, c, k, torch.Generator().manual_seed(7))
    block = a @ bt.T
    rms = float(block.pow(2).mean().sqrt())
    for delta in (1000.0, rms, 0.1 * rms):
        lie = block.clone()
        lie[r // 2, c - 1] += delta
        v = verdict(a, bt, lie)
        assert not v.passed and v.row == r // 2, (delta, v)
    swapped = block.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the right numbers in the wrong rows: several wrong elements a row,
    # whose errors cancel in C·x only for an unlucky x (measured: 6 of 3,000 fresh vectors at 128 x 64, K = 4096)
    assert sum(verdict(a, bt, swapped).passed for _ in range(3)) <= 1
    assert not verdict(a, bt, torch.zeros_like(block)).passed


def test_a_lie_a_hundredth_of_an_element_is_caught_in_a_small_tile() -> None:
    """The 0.01 a lying test worker adds (`CLEAVE_WORKER_CORRUPT`) to a tile of the tiny model's size."""
    g = torch.Generator().manual_seed(3)
    a, bt = torch.randn(64, 64, generator=g), 0.02 * torch.randn(64, 64, generator=g)
    lie = a @ bt.T
    lie[0, 0] += 0.01
    assert not verdict(a, bt, lie).passed


def test_zeros_and_values_near_the_float32_limit() -> None:
    a, bt = torch.zeros(8, 16), torch.randn(8, 16)
    assert verdict(a, bt, torch.zeros(8, 8)).passed
    a, bt = torch.full((4, 8), 1e19), torch.full((4, 8), 2.5e18)  # each element 2e38: its row sums overflow float32
    block = a @ bt.T
    assert torch.isfinite(block).all() and verdict(a, bt, block).passed  # judged in float64
    lie = block.clone()
    lie[2, 1] = 1.9e38
    assert not verdict(a, bt, lie).passed


def test_random_vectors_are_fresh_and_bounded() -> None:
    xs = [freivalds.random_vector(256) for _ in range(3)]
    assert all(x.dtype == np.float32 and (np.abs(x) >= 1).all() and (np.abs(x) < 2).all() for x in xs)
    assert not np.array_equal(xs[0], xs[1]) and (xs[0] < 0).any() and (xs[0] > 0).any()


def test_the_check_costs_a_small_fraction_of_the_tile() -> None:
    """O(rows·K + cols·K + rows·cols) against the tile's O(rows·cols·K), for the 1024 x 1024 tile at K = 4096
    (~9 MFLOP against 8.6 GFLOP, but the check is bound by memory: it reads the tile's inputs once). Measured
    as the process's CPU time (the product may use every core): 0.06 of the product on this test's machine."""
    g = torch.Generator().manual_seed(0)
    a, bt = torch.randn(1024, 4096, generator=g), torch.randn(1024, 4096, generator=g)
    block = a @ bt.T
    norms = freivalds.Norms(a, bt).ready()

    def cpu(fn, reps: int = 3) -> float:
        fn()
        start = time.process_time()
        for _ in range(reps):
            fn()
        return (time.process_time() - start) / reps

    product = cpu(lambda: a @ bt.T)
    check = cpu(lambda: freivalds.check(norms, 0, 1024, 0, 1024, block.numpy()))
    assert check < 0.25 * product, (check, product)


def test_a_strip_draws_its_vector_once_per_gemm_run_and_each_block_is_judged_alone() -> None:
    """The blocks of one column strip share x and Btᵀ·x (computed by the strip's first check); another GEMM run
    draws its own. A lie in one block of a strip fails that block only, and is named by its row."""
    g = torch.Generator().manual_seed(5)
    a, bt = torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g)
    norms = freivalds.Norms(a, bt).ready()
    first = norms.strip(0, 32)
    assert norms.strip(0, 32) is first and norms.strip(0, 16) is not first
    assert not np.array_equal(freivalds.Norms(a, bt).ready().strip(0, 32).x, first.x)
    product = (a @ bt.T).numpy()
    lie = product[32:].copy()
    lie[5, 7] += 0.01 * float(np.sqrt((product**2).mean()))
    assert freivalds.check(norms, 0, 32, 0, 32, product[:32].copy()).passed
    v = freivalds.check(norms, 32, 64, 0, 32, lie)
    assert not v.passed and v.row == 5


@pytest.mark.parametrize("cols", [8, 300])  # one conversion; several chunks of CHUNK_ELEMENTS
def test_transposed_inputs_are_read_in_their_own_layout_with_the_same_products(cols: int) -> None:
    """dX's Bᵀ is a weight's transposed view and dW's inputs are transposed activations: Btᵀ·x and the row
    norms come out as from contiguous copies, and the verdicts are the same."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(cols, 384, generator=g), freivalds.random_vector(cols).astype(np.float64)
    for bt in (w.numpy(), np.asfortranarray(w.numpy()), w.t().contiguous().t().numpy()):
        scale = np.abs(x) @ np.abs(w.numpy().astype(np.float64))  # (an entry may cancel to near zero)
        exact_y = x @ w.numpy().astype(np.float64)
        assert (np.abs(freivalds.btx64_exact(bt, x) - exact_y) <= cols * 2.0**-53 * scale).all()
        # partial sums in float32 (contiguous rows): within the rounding the tolerance allows for them
        y = freivalds.btx64(bt, x.astype(np.float32), x)
        xb = np.sqrt(x**2 @ (w.numpy().astype(np.float64) ** 2).sum(1))
        assert np.linalg.norm(y - exact_y) <= freivalds.U32 * np.sqrt(freivalds.PARTIAL) * xb
        exact = (w.numpy().astype(np.float64) ** 2).sum(1)  # bounded from above whatever the order of the sums
        assert (freivalds.row_squares(bt) >= exact).all() and (freivalds.row_squares(bt) <= exact * (1 + 1e-4)).all()
    dy, act = torch.randn(256, cols, generator=g), torch.randn(256, 96, generator=g)
    for a, bt in ((dy, w.t()), (dy.t(), act.t())):  # dX = dY·W, dW = dYᵀ·X, as the PS deals them (views)
        norms = freivalds.Norms(a, bt)
        product = (a @ bt.T).numpy()
        block = product[:64, :40].copy()
        assert freivalds.check(norms, 0, 64, 0, 40, block).passed
        block[3, 5] += 0.01 * float(np.sqrt((product**2).mean()))
        v = freivalds.check(norms, 0, 64, 0, 40, block)
        assert not v.passed and v.row == 3


@pytest.mark.parametrize(("dtype", "lie"), [(torch.float32, 0.01), (torch.bfloat16, 2.0)])
def test_planned_strips_read_a_once_and_judge_each_block_as_unplanned_ones(dtype: torch.dtype, lie: float) -> None:
    """With the run's column strips known, the first check computes every strip's y and A·[y₁ … y_S] in one
    product; the blocks' verdicts are those of strips computed one by one, and a lie (a multiple of the
    block's RMS, above what the dtype's rounding hides) fails its block only."""
    g = torch.Generator().manual_seed(11)
    a, bt = torch.randn(96, 256, generator=g).to(dtype), torch.randn(70, 256, generator=g).to(dtype)
    strips = ((0, 30), (30, 64), (64, 70))
    planned, lazy = freivalds.Norms(a, bt, strips).ready(), freivalds.Norms(a, bt).ready()
    assert planned.ay.shape == planned.tol.shape == (3, 96)  # a strip a row
    assert [planned.strip(*s).column for s in strips] == [0, 1, 2]
    assert lazy.ay is None and lazy.strip(0, 30).column == -1
    name = codec.dtype_name(dtype)
    exact = a.float() @ bt.float().T
    product = exact.to(dtype)

    def block_of(t: torch.Tensor) -> np.ndarray:
        raw = (t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous()).numpy()
        return freivalds.block_float32(raw, name)

    rms = float(exact.pow(2).mean().sqrt())
    for r0, r1 in ((0, 50), (50, 96)):
        for c0, c1 in strips:
            block = block_of(product[r0:r1, c0:c1])
            assert freivalds.check(planned, r0, r1, c0, c1, block, name).passed
            assert freivalds.check(lazy, r0, r1, c0, c1, block, name).passed
            wrong = product[r0:r1, c0:c1].clone()
            wrong[7, 1] += lie * rms
            v = freivalds.check(planned, r0, r1, c0, c1, block_of(wrong), name)
            assert not v.passed and v.row == 7
    assert freivalds.check(planned, 0, 50, 10, 40, block_of(product[:50, 10:40]), name).passed  # a strip not planned


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inputs_convert_to_float32_as_torch_converts_them_in_any_layout(dtype: torch.dtype) -> None:
    """The check converts half-precision inputs with numpy (not torch's thread pool): bit for bit what
    `Tensor.float()` gives, signed zeros and infinities included, for transposed views and row slices."""
    t = torch.randn(37, 53, generator=torch.Generator().manual_seed(2)).to(dtype)
    t[0, 0], t[1, 1], t[2, 2] = -0.0, float("inf"), float("-inf")
    for view in (t, t.t(), t[3:9], t.t()[5:20]):
        got, want = freivalds.as_float32(view), view.float().numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_strips_refuse_huge_lies_and_lies_about_overflowing_products(dtype: torch.dtype) -> None:
    """A planned strip's quick verdict never passes a block because its tolerance overflowed float32: a
    finite block for a product that overflows float32, and one huge element in a block of ordinary values."""
    name = codec.dtype_name(dtype)

    def block_of(t: torch.Tensor) -> np.ndarray:
        t = t.to(dtype).contiguous()
        return freivalds.block_float32((t.view(torch.int16) if dtype == torch.bfloat16 else t).numpy(), name)

    a, bt = torch.full((4, 8), 1e20).to(dtype), torch.full((4, 8), 1e20).to(dtype)  # each product 1e40
    norms = freivalds.Norms(a, bt, ((0, 4),))
    assert not freivalds.check(norms, 0, 4, 0, 4, block_of(torch.ones(4, 4)), name).passed
    g = torch.Generator().manual_seed(4)
    a, bt = torch.randn(32, 64, generator=g).to(dtype), torch.randn(16, 64, generator=g).to(dtype)
    norms = freivalds.Norms(a, bt, ((0, 16),))
    lie = a.float() @ bt.float().T
    lie[3, 3] = 1e30
    v = freivalds.check(norms, 0, 32, 0, 16, block_of(lie), name)
    assert not v.passed and v.row == 3


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize(("dtype", "scale"), [(torch.float16, 1e-7), (torch.bfloat16, 1e-24), (torch.float32, 1e-24)])
def test_tiny_half_precision_blocks_of_a_large_learning_rate_pass(dtype: torch.dtype, scale: float,
                                                                 planned: bool) -> None:
    """Honest blocks refused at a large learning rate (and the job hung once every worker was expelled): a
    float16 weight gradient with subnormal elements (rounded by half their spacing, not relatively), and a
    bfloat16 dX of 1e-23s whose squares underflowed float32 (its rounding term was 0). Lies are still caught."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(64, 128, generator=g) * scale).to(dtype)
    bt = torch.randn(48, 128, generator=g).to(dtype)
    name = codec.dtype_name(dtype)

    def block_of(t: torch.Tensor) -> np.ndarray:
        t = t.to(dtype).contiguous()
        return freivalds.block_float32((t.view(torch.int16) if dtype == torch.bfloat16 else t).numpy(), name)

    exact = a.float() @ bt.float().T
    if dtype == torch.float16:
        assert ((exact.to(dtype).abs() < 2**-14) & (exact.to(dtype) != 0)).float().mean() > 0.5  # mostly subnormal
    norms = freivalds.Norms(a, bt, ((0, 48),) if planned else ())
    assert max(freivalds.check(norms, 0, 64, 0, 48, block_of(exact), name).worst for _ in range(3)) < 1.0
    lie = exact.clone()
    lie[9, 4] += 8 * float(exact.abs().max())
    v = freivalds.check(norms, 0, 64, 0, 48, block_of(lie), name)
    assert not v.passed and v.row == 9


def test_an_honest_float16_overflow_is_accepted_and_a_lying_infinity_is_not() -> None:
    """A float16 job at a large learning rate: the exact product of a few elements lies beyond float16's range,
    and the worker's block holds infinities there, as the reference's does (which then skips the step). It was
    refused as not finite and re-sent for ever. An infinity where the product is finite, one of the wrong sign,
    or a lie in the finite rest, is still refused."""
    from cleave.gemm.tiles import Tile
    from cleave_ps.fleet.examine import examine
    from cleave_ps.fleet.runs import GemmRun

    g = torch.Generator().manual_seed(6)
    a, bt = torch.randn(32, 64, generator=g).half(), torch.randn(16, 64, generator=g).half()
    a[3] = 200.0
    bt[5] = 100.0  # element (3, 5): 64 x 20,000 = 1.28e6, beyond 65,504
    run = GemmRun(seq=1, step=0, op=0, name="lm_head.dw", a=a, bt=bt, out=torch.empty(32, 16, dtype=torch.float16))
    t = Tile(0, 0, 32, 0, 16)
    honest = (a.float() @ bt.float().T).half()
    assert torch.isinf(honest[3, 5]) and torch.isfinite(honest).sum() == 32 * 16 - 1

    def verdict(block: torch.Tensor) -> str:
        return examine(run, t, block.numpy(), "float16")[0]

    assert verdict(honest) == ""
    for lie in ((3, 5, float("-inf")), (0, 0, float("inf")), (1, 1, 123.0)):
        wrong = honest.clone()
        wrong[lie[0], lie[1]] = lie[2]
        assert verdict(wrong) in ("not_finite", "wrong_block"), lie
    nan = honest.clone()
    nan[3, 5] = float("nan")
    assert verdict(nan) == "not_finite"
