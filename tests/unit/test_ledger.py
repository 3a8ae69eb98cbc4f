"""The PS's tile ledger: each tile done once, lost work re-queued, duplicates counted."""

from cleave.gemm import tiles
from cleave.gemm.ledger import GemmLedger


def ledger(n=4):
    return GemmLedger(tiles.grid(n, 1, 1, 1))


def test_each_tile_is_done_exactly_once():
    led = ledger()
    a = led.take("w1", 0.0)
    assert led.finish(a.tile, a.attempt) == "accepted"
    assert led.finish(a.tile, a.attempt) == "duplicate"
    assert led.duplicates == 1 and led.done == {a.tile}


def test_unissued_results_are_unknown():
    led = ledger()
    assert led.finish(0, 0) == "unknown"
    assert led.finish(99, 0) == "unknown"
    a = led.take("w1", 0.0)
    assert led.finish(a.tile, a.attempt + 1) == "unknown"


def test_lost_worker_tiles_go_back_to_the_front():
    led = ledger()
    a, b = led.take("w1", 0.0), led.take("w2", 0.0)
    assert led.give_back("w1") == [a.tile]
    again = led.take("w2", 1.0)
    assert again.tile == a.tile and again.attempt == 1
    assert led.resent == 1
    # the late result of the first attempt still counts if it comes first; the second is then a duplicate
    assert led.finish(a.tile, 0) == "accepted"
    assert led.finish(again.tile, again.attempt) == "duplicate"
    assert led.finish(b.tile, b.attempt) == "accepted"


def test_affinity_prefers_cached_inputs():
    led = GemmLedger(tiles.grid(4, 4, 2, 2))
    pick = led.take("w1", 0.0, score=lambda t: 10 if (t.r0, t.c0) == (2, 2) else 0)
    assert (led.tiles[pick.tile].r0, led.tiles[pick.tile].c0) == (2, 2)


def test_completes_after_every_tile():
    led = ledger(3)
    while (a := led.take("w", 0.0)) is not None:
        assert not led.complete
        led.finish(a.tile, a.attempt)
    assert led.complete


def test_planned_owners_first_then_stealing():
    led = GemmLedger(tiles.grid(4, 1, 1, 1), owners=["fast", "slow", "slow", "slow"])
    own = led.take("fast", 0.0)
    assert own.tile == 0
    assert led.take("fast", 0.0) is None  # busy: a stolen tile would only queue behind its own
    led.finish(own.tile, own.attempt)
    stolen = led.take("fast", 0.0)  # idle, its own list empty: it steals from the device with the most left
    assert stolen.tile == 3
    assert led.take("slow", 0.0).tile == 1


def test_a_lost_owner_hands_its_planned_tiles_to_others():
    led = GemmLedger(tiles.grid(3, 1, 1, 1), owners=["a", "b", "b"])
    b = led.take("b", 0.0)
    assert led.give_back("b") == [b.tile]
    got = {led.take("a", 0.0).tile for _ in range(3)}
    assert got == {0, 1, 2}


def test_speculation_copies_the_oldest_straggler_once():
    led = ledger(2)
    a = led.take("slow", 0.0)
    b = led.take("slow", 5.0)
    assert led.copy_late("idle", 6.0, min_age_s=10.0) is None  # nobody is late yet
    spec = led.copy_late("idle", 12.0, min_age_s=10.0)
    assert spec.tile == a.tile and spec.attempt == 1
    assert led.copy_late("idle2", 12.0, min_age_s=10.0) is None  # b is young; a already has a twin
    assert led.finish(spec.tile, spec.attempt) == "accepted"  # first result wins
    assert led.finish(a.tile, a.attempt) == "duplicate"
    assert led.finish(b.tile, b.attempt) == "accepted" and led.complete


def test_a_lost_block_is_cut_for_several_devices():
    blocks = [tiles.Tile(0, 0, 256, 0, 64), tiles.Tile(1, 256, 512, 0, 64), tiles.Tile(2, 0, 512, 64, 128)]
    led = GemmLedger(blocks, ["w1", "w2", "w1"])
    a, b = led.take("w1", 0.0), led.take("w2", 0.0)
    lost = led.give_back("w1", split=4)  # its running block and its planned one are cut in 4
    assert len(lost) == 4 and led.retired == {a.tile, 2} and len(led.tiles) == 11
    assert len(blocks) == 3  # the caller's list of tiles is left alone
    assert all(led.parent[k] == a.tile for k in lost) and led.pending[0] == lost[0]  # running ones first
    live = [t for t in led.tiles if t.index not in led.retired]
    tiles.check_cover(live, 512, 128)  # the cut tiles and the others still cover the output once
    assert led.finish(a.tile, a.attempt) == "duplicate"  # the lost worker's late answer for the whole block
    assert led.finish(b.tile, b.attempt) == "accepted"
    got = [led.take(w, 1.0) for w in ("w2", "w3", "w4", "w5")]
    assert {g.tile for g in got} == set(lost) and led.dealable()
    for g in got[:3]:
        led.finish(g.tile, g.attempt)
    assert not led.covered(a.tile) and not led.complete
    led.finish(got[3].tile, got[3].attempt)
    assert led.covered(a.tile) and not led.covered(2) and not led.complete
    while (g := led.take("w2", 2.0)) is not None:
        led.finish(g.tile, g.attempt)
    assert led.complete and led.covered(2) and not led.dealable()
