"""The dealing core on its own (no bus, no clock of its own): randomized fleets that join, vanish, freeze and
answer late; every tile is done exactly once, and nothing waits for a worker that is gone."""

import random

import pytest

from cleave.gemm import tiles
from cleave.gemm.dealer import Policy, ProveLink, Work, WorkerLost
from cleave.schemas import DeviceProfile
from tests.unit.dealing import Dealing


def profile(flops=1e9, down=1e7, up=5e6):
    return DeviceProfile(flops=flops, memory_bytes=1 << 30, downlink_bytes_per_s=down, uplink_bytes_per_s=up,
                         latency_s=0.01)


def work(m=64, n=48, rows=8, cols=8, owners=None, seq=1, chunks=1):
    grid = tiles.grid(m, n, rows, cols)
    return Work(seq, m, n, 16, 4, grid, owners(grid) if owners else None, chunks)


def left(dealer: Dealing, sends, at: float):
    """The sends left the PS at `at` (as the PS tells its dealer once each is published): copies may follow."""
    for s in sends:
        dealer.departed(s.tile.index, s.attempt, at, s.seq)
    return sends


def drive(dealer: Dealing, w: Work, rng: random.Random, workers: list[str], *, joins=(), vanish=0.2,
          freeze=0.1, late=0.3, max_events=200_000):
    """Play a fleet against the dealer until the GEMM is complete: each send is answered after a random
    delay, except by workers that vanish (never answer), freeze (answer very late) or are dropped by a
    plan; results come back in random order. Returns how often each tile was accepted."""
    now = 0.0
    inbox: list[tuple[float, str, int, int]] = []
    gone, frozen = set(), set()
    accepted: dict[int, int] = {}

    def post(sends):
        for s in left(dealer, sends, now):
            if s.worker in gone:
                continue
            delay = rng.uniform(0.01, 0.2) * (50 if s.worker in frozen else 1)
            inbox.append((now + delay, s.worker, s.tile.index, s.attempt))

    post(dealer.begin(w, now))
    pending_joins = list(joins)
    for _ in range(max_events):
        if dealer.complete:
            return accepted, gone
        if pending_joins and rng.random() < 0.01:
            workers.append(pending_joins.pop())
            post(dealer.set_fleet([(x, 1 << 20, profile()) for x in workers if x not in gone], now))
        if rng.random() < 0.05 * vanish and len(workers) - len(gone) > 2:
            victim = rng.choice([x for x in workers if x not in gone])
            gone.add(victim)
            if rng.random() < 0.5:  # the scheduler notices, or only the deadline does
                post(dealer.set_fleet([(x, 1 << 20, profile()) for x in workers if x not in gone], now))
        if rng.random() < 0.05 * freeze:
            frozen.add(rng.choice(workers))
        inbox.sort()
        if inbox and (rng.random() > late or len(inbox) == 1):
            at, worker, tile, attempt = inbox.pop(0)
        elif inbox:
            at, worker, tile, attempt = inbox.pop(rng.randrange(len(inbox)))  # out of order
        else:
            at = now + 0.05
            worker = None
        now = max(now, at)
        if worker is not None and worker not in gone:
            outcome, sends = dealer.done(worker, tile, attempt, now)
            if outcome == "accepted":
                accepted[tile] = accepted.get(tile, 0) + 1
            post(sends)
        post(dealer.tick(now))
        if not inbox and not dealer.complete:
            now = max(now, min(dealer.next_check_at(now), now + 1.0))
            post(dealer.tick(now))
    raise AssertionError("the GEMM never completed")


def run_fleet(seed):
    """One randomized GEMM (see `drive`); checks that every tile was done exactly once."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.randint(3, 12))]
    dealer = Dealing(Policy(window=rng.choice([1, 2, 3]), tile_timeout_s=0.5, speculate_min_s=0.05,
                           max_inflight_bytes=rng.choice([None, 4096])))
    dealer.set_fleet([(x, 1 << 20, profile()) for x in workers], 0.0)
    planned = seed % 2 == 0

    def owners(grid):
        return [workers[i % len(workers)] for i in range(len(grid))] if planned else None

    w = work(m=128, n=96, owners=owners if planned else None, chunks=1 + seed % 3)
    accepted, gone = drive(dealer, w, rng, workers, joins=[f"late{i}" for i in range(3)])
    led = dealer.deal().ledger
    live = [t for t in led.tiles if t.index not in led.retired]
    tiles.check_cover(live, w.m, w.n)  # the live tiles (lost blocks cut into pieces) cover the output once
    assert all(accepted.get(t.index) == 1 for t in live)  # each exactly once
    assert all(led.covered(t.index) for t in led.tiles)
    for rec in dealer.deal().recoveries:
        assert rec.done_at is not None and not rec.tiles
    return len(gone), len(dealer.deal().recoveries), led.copied, led.duplicates


@pytest.mark.parametrize("seed", range(12))
def test_every_tile_is_done_exactly_once_under_churn(seed):
    run_fleet(seed)


def test_the_randomized_fleets_do_lose_workers_and_copy_tiles():
    stats = [run_fleet(seed) for seed in range(12)]
    assert sum(g for g, _, _, _ in stats) >= 6 and sum(r for _, r, _, _ in stats) >= 6
    assert sum(s for _, _, s, _ in stats) >= 6 and sum(d for _, _, _, d in stats) >= 1


def test_deadline_suspects_a_silent_worker_and_tries_it_again_later():
    dealer = Dealing(Policy(window=1, tile_timeout_s=1.0, speculate_factor=0))
    dealer.set_fleet([("a", 1 << 20, None), ("b", 1 << 20, None)], 0.0)
    sends = dealer.begin(work(m=8, n=8, rows=4, cols=4), 0.0)
    first_b = next(s for s in sends if s.worker == "b")
    assert dealer.next_check_at(0.0) == pytest.approx(1.0)
    # a answers promptly, b says nothing: at t = 1 b is presumed lost and its tile goes to a
    for s in sends:
        if s.worker == "a":
            _, more = dealer.done("a", s.tile.index, s.attempt, 0.1)
    again = dealer.tick(1.01)
    assert dealer.members["b"].suspect and [(n.worker, n.cause) for n in dealer.told(WorkerLost)] == [("b", "tile_deadline")]
    assert dealer.deal().recoveries[0].worker == "b" and dealer.deal().recoveries[0].cause == "tile_deadline"
    assert not any(s.worker == "b" for s in again)
    # b's late answer still counts if it comes first, and clears its suspicion
    outcome, _ = dealer.done("b", first_b.tile.index, first_b.attempt, 1.2)
    assert outcome == "accepted" and not dealer.members["b"].suspect


def test_a_suspect_retried_gets_tiles_only_once_its_link_is_proven():
    """After `suspect_retry` tile timeouts a suspect is checked again, not dealt to: the shell proves its
    downlink (`ProveLink`, a round trip) and only `proved` deals it tiles."""
    dealer = Dealing(Policy(window=1, tile_timeout_s=1.0, speculate_factor=0, suspect_retry=2.0))
    dealer.set_fleet([("a", 1 << 20, None), ("b", 1 << 20, None)], 0.0)
    dealer.begin(work(m=64, n=64, rows=4, cols=4), 0.0)
    dealer.tick(1.01)  # b (like a) has said nothing for a tile timeout
    assert dealer.members["b"].suspect and dealer.told(ProveLink) == []
    assert dealer.next_check_at(1.01) == pytest.approx(3.01)
    retried = dealer.tick(3.02)
    assert not any(s.worker == "b" for s in retried) and not dealer._count("b")
    assert dealer.told(ProveLink) == [ProveLink("a"), ProveLink("b")] and not dealer.members["b"].proven
    assert dealer.told(ProveLink) == []  # each asked for once
    sends = dealer.proved("b", 3.1)
    assert sends and {s.worker for s in sends} == {"b"} and dealer.members["b"].proven
    assert dealer.proved("b", 3.2) == []  # proven already: nothing more


def test_cached_blocks_do_not_travel_again_and_misses_resend_them():
    dealer = Dealing(Policy(window=1))
    dealer.set_fleet([("a", 1 << 20, None)], 0.0)
    w = work(m=4, n=8, rows=4, cols=4)  # two tiles sharing rows 0:4 of A
    (s1,) = dealer.begin(w, 0.0)
    assert s1.a.data and s1.b.data and s1.nbytes == (4 + 4) * 16 * 4
    _, (s2,) = dealer.done("a", s1.tile.index, s1.attempt, 0.1)
    assert not s2.a.data and s2.b.data  # the shared row block is cached: only the columns travel
    (s3,) = dealer.failed("a", s2.tile.index, s2.attempt, 0.2, missing=[s2.a.id])  # the worker evicted it
    assert s3.tile == s2.tile and s3.a.data  # sent again, with its data


def test_a_byte_budget_keeps_one_tile_in_flight_past_it():
    dealer = Dealing(Policy(window=4, max_inflight_bytes=600))
    dealer.set_fleet([("a", 1 << 20, None)], 0.0)
    sends = dealer.begin(work(m=4, n=32, rows=4, cols=4), 0.0)  # each tile carries >= 256 bytes
    assert 1 <= len(sends) < 4
    assert dealer.members["a"].inflight_bytes >= 600 or len(sends) == 1


def test_stealing_takes_from_the_device_with_the_most_left():
    owners = lambda grid: ["fast"] + ["slow"] * (len(grid) - 1)  # noqa: E731
    dealer = Dealing(Policy(window=1))
    dealer.set_fleet([("fast", 1 << 20, None), ("slow", 1 << 20, None)], 0.0)
    w = work(m=4, n=16, rows=4, cols=4, owners=owners)
    sends = dealer.begin(w, 0.0)
    fast = next(s for s in sends if s.worker == "fast")
    _, more = dealer.done("fast", fast.tile.index, fast.attempt, 0.1)
    assert [s.tile.index for s in more] == [3]  # the last of slow's planned tiles


def test_an_idle_worker_copies_a_straggling_tile():
    dealer = Dealing(Policy(window=1, speculate_factor=3.0, speculate_min_s=0.2, tick_s=0.05))
    dealer.set_fleet([("a", 1 << 20, None), ("b", 1 << 20, None)], 0.0)
    sends = left(dealer, dealer.begin(work(m=4, n=8, rows=4, cols=4), 0.0), 0.0)
    a = next(s for s in sends if s.worker == "a")
    b = next(s for s in sends if s.worker == "b")
    _, more = dealer.done("a", a.tile.index, a.attempt, 0.1)  # a is now idle; its round trip is 0.1 s
    assert more == []
    at = dealer.next_check_at(0.1)
    assert at == pytest.approx(0.3)  # b's tile runs past max(0.2, 3 x 0.1)
    copy = dealer.tick(at + 1e-6)
    assert [(s.worker, s.tile.index) for s in copy] == [("a", b.tile.index)]
    outcome, _ = dealer.done("a", b.tile.index, copy[0].attempt, 0.5)
    assert outcome == "accepted" and dealer.complete
    assert dealer.done("b", b.tile.index, b.attempt, 0.6)[0] == "duplicate"


def test_a_refused_tile_goes_to_another_worker_unless_nobody_else_is_there():
    dealer = Dealing(Policy(window=1))
    dealer.set_fleet([("small", 1 << 20, None), ("big", 1 << 20, None)], 0.0)
    sends = dealer.begin(work(m=4, n=12, rows=4, cols=4), 0.0)  # three tiles, one each, one queued
    small = next(s for s in sends if s.worker == "small")
    big = next(s for s in sends if s.worker == "big")
    again = dealer.failed("small", small.tile.index, small.attempt, 0.1)  # "over my memory budget"
    assert all(s.tile != small.tile for s in again if s.worker == "small")
    _, more = dealer.done("big", big.tile.index, big.attempt, 0.2)
    assert [s.tile.index for s in more] == [small.tile.index]  # big, once free, takes the refused tile
    alone = Dealing(Policy(window=1))
    alone.set_fleet([("only", 1 << 20, None)], 0.0)
    (s,) = alone.begin(work(m=4, n=4, rows=4, cols=4), 0.0)
    retry = alone.failed("only", s.tile.index, s.attempt, 0.1)
    assert [x.tile for x in retry] == [s.tile]  # nobody else: it is tried again rather than left undealt


def test_a_returning_worker_gets_tiles_only_once_its_link_is_proven():
    dealer = Dealing(Policy(window=1, speculate_factor=0))
    dealer.set_fleet([("a", 1 << 20, None), ("b", 1 << 20, None)], 0.0)
    assert dealer.told(ProveLink) == []  # first-timers are dealt at once
    sends = dealer.begin(work(m=4, n=32, rows=4, cols=4), 0.0)
    dealer.set_fleet([("a", 1 << 20, None)], 0.5)  # b's heartbeats stopped: it left the plan
    back = dealer.set_fleet([("a", 1 << 20, None), ("b", 1 << 20, None)], 1.0)  # ... and came back
    assert dealer.told(ProveLink) == [ProveLink("b")] and not dealer.members["b"].proven
    assert not [s for s in back if s.worker == "b"]
    now, dealt_b = 1.0, []
    for _ in range(3):  # a answers; whatever it frees goes to a, never to the unproven b
        s = next(s for s in sends if s.worker == "a")
        now += 0.1
        _, sends = dealer.done("a", s.tile.index, s.attempt, now)
        dealt_b += [x for x in sends if x.worker == "b"]
    assert dealt_b == [] and not [x for x in dealer.tick(now + 5.0) if x.worker == "b"]
    proven = dealer.proved("b", now)
    assert proven and {s.worker for s in proven} == {"b"} and dealer.members["b"].proven
    assert dealer.proved("b", now) == []  # once


def test_a_worker_whose_tiles_copies_keep_finishing_first_is_suspect():
    dealer = Dealing(Policy(window=1, tile_timeout_s=100.0, speculate_factor=1.0, speculate_min_s=0.01, tick_s=0.01))
    dealer.set_fleet([("slow", 1 << 20, None), ("fast", 1 << 20, None)], 0.0)
    now, beaten = 0.0, []
    for seq in range(1, 5):  # GEMM after GEMM, fast finishes and then copies slow's last tile, which wins
        inbox = {s.worker: s for s in left(dealer, dealer.begin(work(m=4, n=64, rows=4, cols=4, seq=seq), now), now)}
        assert ("slow" in inbox) == (seq <= 3)  # suspect after the third: dealt nothing in the fourth
        while not dealer.complete:
            now += 0.05
            s = inbox.pop("fast", None)  # slow never answers in time (its deadline is 100 s away)
            more = dealer.done("fast", s.tile.index, s.attempt, now)[1] if s is not None else dealer.tick(now)
            inbox.update({x.worker: x for x in left(dealer, more, now)})
        dealer.end()
        beaten.append(dealer.members["slow"].beaten)
    assert beaten == [1, 2, 0, 0] and dealer.members["slow"].suspect
    assert [(n.worker, n.cause) for n in dealer.told(WorkerLost)] == [("slow", "duplicates")]


@pytest.mark.parametrize("share, copies", [(0.1, 2), (10.0, 5)])
def test_copies_of_late_tiles_stop_at_their_share_of_the_gemms_bytes(share, copies):
    """Copies must not load the PS link without bound: a GEMM's copies may carry at most `copy_share` of the bytes its other tiles did (here each copy sends one
    B block of 256 bytes, the GEMM sent 3,072), and then the dealer stops asking to be called for copies."""
    dealer = Dealing(Policy(window=1, tile_timeout_s=100.0, speculate_factor=1.0, speculate_min_s=0.01, tick_s=0.01,
                           copy_share=share))
    dealer.set_fleet([(w, 1 << 20, None) for w in ("f", "s1", "s2", "s3", "s4", "s5")], 0.0)
    sends = left(dealer, dealer.begin(work(m=4, n=24, rows=4, cols=4), 0.0), 0.0)  # one each; only f answers
    f = next(s for s in sends if s.worker == "f")
    now, inbox = 0.1, left(dealer, dealer.done("f", f.tile.index, f.attempt, 0.1)[1], 0.1)
    made = []
    while inbox or (at := dealer.next_check_at(now)) < 50.0:
        if not inbox:
            now = at + 1e-6
            inbox = left(dealer, dealer.tick(now), now)
            continue
        s = inbox.pop()
        assert s.nbytes == 256  # every worker caches the A block all six tiles share
        made.append(s.tile.index)
        if s.worker == "f":  # (a worker whose tile a copy finished is free for copies too, and never answers)
            now += 0.01
            inbox += left(dealer, dealer.done("f", s.tile.index, s.attempt, now)[1], now)
    assert len(made) == dealer.deal().ledger.copied == copies
    assert dealer.deal().copy_bytes == 256 * copies and dealer.deal().sent_bytes == 6 * 512


def test_no_copy_is_dealt_while_sends_are_still_to_leave_the_ps():
    """A tile waiting behind the PS's own link looks late to an idle worker; a copy would queue behind the
    same sends and slow them: copies wait until what was dealt has left (the PS says so as it publishes each,
    the simulator says when each will)."""
    dealer = Dealing(Policy(window=1, tile_timeout_s=100.0, speculate_factor=3.0, speculate_min_s=0.2, tick_s=0.05))
    dealer.set_fleet([("a", 1 << 20, None), ("b", 1 << 20, None), ("c", 1 << 20, None)], 0.0)
    sends = dealer.begin(work(m=4, n=12, rows=4, cols=4), 0.0)
    a, b, c = (next(s for s in sends if s.worker == w) for w in "abc")
    left(dealer, [a, b], 0.0)  # c's tile is still being published
    assert dealer.done("a", a.tile.index, a.attempt, 0.1)[1] == []  # a is idle; its round trip is 0.1 s
    assert dealer.next_check_at(0.1) >= 100.0 and dealer.tick(1.0) == []  # b's tile is late, c's not out
    dealer.departed(c.tile.index, c.attempt, 2.0)  # c's leaves at 2.0 (the simulator's PS link says so)
    assert dealer.next_check_at(1.0) == pytest.approx(2.0) and dealer.tick(1.5) == []
    copy = dealer.tick(2.0)
    assert [(s.worker, s.tile.index) for s in copy] == [("a", b.tile.index)]  # the oldest lone tile: b's
