"""Several GEMMs dealt at once by the one dealing core: the GEMM on the critical path first, another's tiles
filling the tails, every tile of every GEMM done exactly once (also when workers vanish), each worker's
room counted over all of them."""

import heapq
import random

import pytest

from cleave.gemm import tiles
from cleave.gemm.dealer import Policy, TilesLost, Work
from tests.unit.dealing import Dealing


def work(seq, m=32, n=32, rows=8, cols=8, owners=None):
    grid = tiles.grid(m, n, rows, cols)
    return Work(seq, m, n, 16, 4, grid, owners(grid) if owners else None)


def play(dealer, gemms, speed, *, vanish=None, seed=0):
    """Answer every send after its worker's time per tile (jittered), in time order, beginning `gemms`
    (seq, priority, begin at) as their time comes; `vanish`: (worker, at) stops answering. Returns each
    GEMM's completion time and every (worker, seq, sent at) in order."""
    rng, heap, order, now, sent = random.Random(seed), [], 0, 0.0, []
    busy = {w: 0.0 for w in speed}
    done_at, begins = {}, sorted(gemms, key=lambda g: g[2])

    def post(sends):
        nonlocal order
        for s in sends:
            sent.append((s.worker, s.seq, now))
            if vanish and s.worker == vanish[0] and now >= vanish[1]:
                continue
            busy[s.worker] = max(busy[s.worker], now) + speed[s.worker] * rng.uniform(0.9, 1.1)
            order += 1
            heapq.heappush(heap, (busy[s.worker], order, s.worker, s.seq, s.tile.index, s.attempt))

    while begins or heap or dealer.deals:
        if begins and begins[0][2] <= (heap[0][0] if heap else float("inf")):
            seq, prio, at = begins.pop(0)
            now = max(now, at)
            post(dealer.begin(work(seq), now, prio))
            continue
        if not heap:
            now = max(now, dealer.next_check_at(now))
            assert now < 1e6, "nothing left to answer and the GEMMs are not done"
            post(dealer.tick(now))
        else:
            now, _, w, seq, tile, attempt = heapq.heappop(heap)
            if vanish and w == vanish[0] and now >= vanish[1] or seq not in dealer.deals or w not in dealer.members:
                continue
            post(dealer.done(w, tile, attempt, now, seq)[1])
            post(dealer.tick(now))
        for seq in [s for s in dealer.deals if dealer.is_complete(s)]:
            deal = dealer.deals[seq]
            assert deal.ledger.done | deal.ledger.retired == set(range(len(deal.ledger.tiles)))
            done_at[seq] = now
            dealer.end(seq)
    return done_at, sent


def fleet(dealer, ids):
    dealer.set_fleet([(w, 1 << 20, None) for w in ids], 0.0)


def test_the_critical_gemm_is_dealt_first_and_the_other_fills_its_tail():
    dealer = Dealing(Policy(window=2, speculate_factor=0))
    fleet(dealer, ["fast", "slow"])
    first = dealer.begin(work(1), 0.0, priority=0)
    assert {s.seq for s in first} == {1} and len(first) == 4  # both workers' rooms are full of GEMM 1
    assert dealer.begin(work(2), 0.0, priority=1) == []  # no room left: GEMM 2 waits for it
    # the fast worker answers everything it gets: once GEMM 1 has nothing left to deal it takes GEMM 2's
    seqs = []
    pending = [s for s in first if s.worker == "fast"]
    now = 0.0
    while pending:
        s = pending.pop(0)
        now += 0.1
        if s.seq not in dealer.deals:
            continue
        _, more = dealer.done("fast", s.tile.index, s.attempt, now, s.seq)
        seqs += [m.seq for m in more if m.worker == "fast"]
        pending += [m for m in more if m.worker == "fast"]
        if len(seqs) > 40:
            break
    assert seqs and 2 in seqs
    assert seqs.index(2) > 0 and all(q == 1 for q in seqs[: seqs.index(2)])  # 1 while it had tiles, then 2
    assert not dealer.is_complete(1)  # the slow worker still holds GEMM 1's last tiles: its tail was filled
    counts = [sum(d.ledger.count(w) for d in dealer.deals.values()) for w in ("fast", "slow")]
    assert max(counts) <= 2  # the window counts over both GEMMs


def test_a_gemm_that_needs_the_whole_fleet_meanwhile_finishes_sooner():
    """Two GEMMs one after the other, against the second dealt beside the first at a lower priority: the
    fleet's idle tail of the first is filled, so both are done sooner, and the first no later than it
    would be alone by more than a tile."""
    speed = {"a": 1.0, "b": 1.0, "c": 3.0}
    policy = Policy(window=1, speculate_factor=0, tile_timeout_s=10.0)  # (no profiles: no predicted tile time)
    alone = Dealing(policy)
    fleet(alone, speed)
    t1, _ = play(alone, [(1, 0, 0.0)], speed)
    t2, _ = play(alone, [(2, 0, t1[1])], speed)
    together = Dealing(policy)
    fleet(together, speed)
    both, _ = play(together, [(1, 0, 0.0), (2, 1, 0.0)], speed)
    assert max(both.values()) < t2[2] - 1.0
    assert both[1] <= t1[1] + max(speed.values()) * 1.1


@pytest.mark.parametrize("seed", range(6))
def test_every_tile_of_every_gemm_is_done_once_when_a_worker_vanishes(seed):
    rng = random.Random(seed)
    speed = {w: rng.uniform(0.5, 2.0) for w in "abcd"}
    dealer = Dealing(Policy(window=rng.choice([1, 2, 3]), tile_timeout_s=1.0, speculate_min_s=0.5))
    fleet(dealer, speed)
    gemms = [(1, 0, 0.0), (2, 1, 0.5), (3, 0, 3.0), (4, 1, 3.2)]
    done_at, _ = play(dealer, gemms, speed, vanish=(rng.choice("abcd"), rng.uniform(0.5, 4.0)), seed=seed)
    assert set(done_at) == {1, 2, 3, 4}  # (play checks each ledger covers all its tiles)
    lost = [n.recovery for n in dealer.told(TilesLost)]
    assert all(r.seq in (1, 2, 3, 4) for r in lost)


def test_a_lost_worker_gives_back_the_tiles_of_every_gemm_and_an_ended_one_frees_its_bytes():
    dealer = Dealing(Policy(window=2, tile_timeout_s=1.0, speculate_factor=0))
    fleet(dealer, ["a", "b"])
    sends = dealer.begin(work(1, m=8, n=16), 0.0, 0) + dealer.begin(work(2), 0.0, 1)
    a1 = [s for s in sends if s.worker == "a" and s.seq == 1]
    for s in a1:  # a finishes its GEMM 1 tiles: it gets GEMM 2's (GEMM 1 has no more)
        _, more = dealer.done("a", s.tile.index, s.attempt, 0.1, 1)
        sends += more
    assert {s.seq for s in sends if s.worker == "a"} == {1, 2}
    b_bytes = dealer.members["b"].inflight_bytes
    assert b_bytes > 0
    dealer.set_fleet([("b", 1 << 20, None)], 0.2)  # a is gone: its GEMM 2 tiles are given back
    lost = [n.recovery for n in dealer.told(TilesLost)]
    assert {r.seq for r in lost} == {2} and all(r.worker == "a" for r in lost)
    assert dealer.deals[2].ledger.queued
    dealer.end(1)  # abandoned with b's tiles in flight: they no longer count against b
    assert dealer.members["b"].inflight_bytes < b_bytes
