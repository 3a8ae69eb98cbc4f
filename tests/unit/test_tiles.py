"""Tile math: exact covers for ragged shapes and exact assembly."""

import random

import pytest
import torch

from cleave.gemm import tiles


@pytest.mark.parametrize("m, n, br, bc", [(1, 1, 1, 1), (7, 5, 3, 2), (100, 37, 32, 64), (64, 64, 64, 64), (5, 9, 10, 10)])
def test_grid_covers_exactly(m, n, br, bc):
    g = tiles.grid(m, n, br, bc)
    tiles.check_cover(g, m, n)
    assert [t.index for t in g] == list(range(len(g)))
    assert max(t.rows for t in g) <= br and max(t.cols for t in g) <= bc


def test_tiled_matmul_matches_one_gemm_on_random_ragged_shapes():
    rng = random.Random(0)
    for _ in range(20):
        m, n, k = rng.randint(1, 90), rng.randint(1, 90), rng.randint(1, 40)
        a, bt = torch.randn(m, k), torch.randn(n, k)
        g = tiles.grid(m, n, rng.randint(1, 40), rng.randint(1, 40))
        torch.testing.assert_close(tiles.tiled_matmul(a, bt, g), a @ bt.T, rtol=1e-5, atol=1e-5)


def test_check_cover_finds_gaps_and_overlaps():
    with pytest.raises(ValueError, match="gap or overlap"):
        tiles.check_cover(tiles.from_boxes([(0, 2, 0, 2), (0, 2, 1, 3)]), 2, 3)
    with pytest.raises(ValueError, match="gap or overlap"):
        tiles.check_cover(tiles.from_boxes([(0, 2, 0, 2)]), 2, 3)
    with pytest.raises(ValueError, match="outside"):
        tiles.check_cover(tiles.from_boxes([(0, 3, 0, 3)]), 2, 3)


def test_cuts_reject_nonsense():
    with pytest.raises(ValueError):
        tiles.cuts(0, 4)
    with pytest.raises(ValueError):
        tiles.cuts(4, 0)


def test_a_uniform_grid_takes_the_plans_tile_or_the_unplanned_one_halved_until_every_worker_has_one():
    assert tiles.uniform_block(4096, 4096, None, 1) == (tiles.UNPLANNED_TILE, tiles.UNPLANNED_TILE)
    assert tiles.uniform_block(4096, 4096, (1024, 512), 1) == (1024, 512)
    rows, cols = tiles.uniform_block(1024, 768, None, 100)
    assert -(-1024 // rows) * -(-768 // cols) >= 100
