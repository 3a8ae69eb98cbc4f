"""Fan-out layouts (pure): blocks that overlap without matching are sent as segments, every segment is the
same rows for each block that holds it, and a planned GEMM's inputs then leave the PS once."""

import numpy as np
import pytest
import torch

from cleave.gemm import fanout, tiles
from cleave.gemm.dealer import Dealer, Policy, Work
from cleave.plan.fleet import synthetic_fleet
from cleave.schemas import BlockPart, BlockRef
from cleave_scheduler.planning import with_layouts
from cleave_scheduler.synthetic import job_shapes, synthetic_registry
from cleave_worker.core import BlockCache

# Three column bands of one GEMM (c_attn.dw of `small` on a real 16-worker loopback plan): each band cuts the
# rows of A in its own pieces, so no whole A block is shared although every row is needed by three bands.
BANDS = [(0, 96, 0, 73), (96, 192, 0, 73), (192, 288, 0, 73), (288, 384, 0, 73),
         (0, 72, 73, 120), (72, 144, 73, 120), (144, 216, 73, 120), (216, 288, 73, 120),
         (288, 312, 73, 120), (312, 336, 73, 120), (336, 360, 73, 120), (360, 384, 73, 120),
         (0, 89, 120, 128), (89, 179, 120, 128), (179, 269, 120, 128), (269, 359, 120, 128),
         (359, 372, 120, 128), (372, 384, 120, 128)]
OWNERS = ["w07"] * 4 + ["w05"] * 4 + ["w04"] * 4 + ["w13"] * 4 + ["w03", "w02"]


def egress_rows(grid, owners, split, shared) -> int:
    """Rows of input the PS sends for one undisturbed GEMM: a shared block or segment once, others per worker."""
    need: dict[str, set[tuple[str, int]]] = {}
    for t, o in zip(grid, owners, strict=True):
        for bid in fanout.inputs(t, split):
            lo, hi = map(int, bid.rsplit(".", 2)[1:])
            need.setdefault(o, set()).add((bid, hi - lo))
    once = {bid: rows for blocks in need.values() for bid, rows in blocks if bid in shared}
    return sum(once.values()) + sum(rows for o, blocks in need.items() for bid, rows in blocks
                                    if bid not in shared or o not in shared[bid][1])


def test_overlapping_blocks_are_cut_into_segments_that_tile_them():
    grid = tiles.from_boxes(BANDS)
    split = fanout.parts(grid, OWNERS)
    assert "b.0.73" not in split  # blocks only matched or missed by others stay whole
    for block, segs in split.items():
        key, lo, hi = block.rsplit(".", 2)
        assert segs[0][1] == int(lo) and segs[-1][2] == int(hi)
        assert all(a[2] == b[1] for a, b in zip(segs, segs[1:], strict=False))  # contiguous, in order
        assert all(s[0] == f"{key}.{s[1]}.{s[2]}" for s in segs)  # the same id as a block of those rows
    assert split["a.0.96"] == (("a.0.72", 0, 72), ("a.72.89", 72, 89), ("a.89.96", 89, 96))


def test_segments_let_each_row_leave_once():
    grid = tiles.from_boxes(BANDS)
    whole = fanout.shared(grid, OWNERS, window=4)
    split, shared = fanout.layout(grid, OWNERS, window=4)
    distinct = 384 + 128
    assert egress_rows(grid, OWNERS, {}, whole) > 1.5 * distinct  # whole blocks: A goes once per band
    assert egress_rows(grid, OWNERS, split, shared) == distinct


def test_a_cost_plan_on_a_synthetic_fleet_sends_its_inputs_about_once():
    reg = synthetic_registry(64, seed=3)
    shapes = job_shapes("opt-125m", 8, 512, 4)
    plan = with_layouts(reg.plan(0.0, 1024, 1024, "start", 4), shapes, "cost", None)
    for g in plan.gemms:
        boxes, owners = [], []
        for i, o in enumerate(g.owners):
            parts = tiles.cut_planned(tuple(int(x) for x in g.boxes[4 * i: 4 * i + 4]), g.k, 4, 1024, 1024, 4, 1 << 27)
            boxes, owners = boxes + parts, owners + [o] * len(parts)
        grid = tiles.from_boxes(boxes)
        split, shared = fanout.layout(grid, owners, window=4)
        assert egress_rows(grid, owners, split, shared) <= 1.1 * (g.m + g.n), g


def test_the_dealer_sends_segments_and_publishes_each_once():
    grid = tiles.from_boxes(BANDS)
    split, shared = fanout.layout(grid, OWNERS, window=4)
    d = Dealer(Policy(window=4))
    fleet = synthetic_fleet(6, seed=0).devices()
    ids = sorted(set(OWNERS))
    d.set_fleet([(w, 1 << 30, dev.profile) for w, dev in zip(ids, fleet, strict=True)], 0.0)
    for w in ids:
        d.join(w, {name for name, members in shared.values() if w in members})
    sends = d.begin(Work(1, 384, 128, 16, 4, grid, OWNERS, 4, "a", "b", shared, split), 0.0)
    published = [leaf.id for s in sends for blk in (s.a, s.b) for leaf in blk.leaves() if leaf.publish]
    assert len(published) == len(set(published))
    a_parts = next(s.a for s in sends if s.tile.r0 == 0 and s.tile.c0 == 0)
    assert [p.id for p in a_parts.parts] == ["a.0.72", "a.72.89", "a.89.96"]
    assert sum(s.nbytes + s.pushed for s in sends) == (384 + 128) * 16 * 4  # every input row once


def test_a_worker_assembles_a_block_from_its_segments_exactly():
    src = torch.randn(96, 16)
    cache = BlockCache(1 << 20)
    from cleave import codec
    cache.resolve(BlockRef(id="a.0.72", tensor=codec.tensor_to_data(src[:72])))  # came on a fan-out subject
    ref = BlockRef(id="a.0.96", parts=(BlockPart(id="a.0.72", fanout=True),
                                       BlockPart(id="a.72.89", tensor=codec.tensor_to_data(src[72:89])),
                                       BlockPart(id="a.89.96", tensor=codec.tensor_to_data(src[89:96]))))
    got = cache.resolve(ref)
    assert got is not None and torch.equal(got, src)
    assert cache.resolve(BlockRef(id="a.0.96", parts=(BlockPart(id="a.0.72"), BlockPart(id="nope")))) is None


@pytest.mark.parametrize("seed", range(3))
def test_segments_never_cross_a_planned_block_boundary(seed):
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, 500], rng.integers(1, 500, 12)]))
    spans = {(int(a), int(b)) for a, b in zip(cuts, cuts[1:], strict=False)}
    spans |= {(int(cuts[0]), int(cuts[3])), (int(cuts[2]), int(cuts[-1]))}
    split = fanout._segments("x", spans)
    ends = {x for s in spans for x in s}
    for (lo, hi), segs in ((s, split.get(f"x.{s[0]}.{s[1]}")) for s in spans):
        inner = {e for e in ends if lo < e < hi}
        if segs is None:
            assert not inner
        else:
            assert {s[1] for s in segs[1:]} == inner
