"""The PS's tile ledger: each tile done once, lost work re-queued, duplicates counted."""

from cleave import tiles
from cleave_ps.ledger import GemmLedger


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
