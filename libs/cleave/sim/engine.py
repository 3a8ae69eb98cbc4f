"""One GEMM, event by event: the PS's own dealing core (`cleave.dealer.Dealer`) deals tiles to simulated
devices that compute them at their actual pace, leave without notice, straggle, and get speculative copies
and re-sent tiles.

Every dealing decision is the dealer's, exactly as in the PS (`cleave_ps.dispatcher` is the other shell
around it); this module only plays the devices and the clock. A device streams its tiles as a worker that
paces itself to a declared profile does (`cleave.profile.streamed`, the `Pacer`'s clock): downlink,
compute and uplink work on consecutive tiles in parallel, so a long run of tiles costs
`latency + max(down / downlink, up / uplink, flops / FLOPS)` and a lone tile the sum of its stages. A
device that has left receives nothing and answers nothing; the dealer notices by its deadline or when a
new plan (`plans`: time, the plan's worker ids) drops it.

The dealer is called at the times its `next_check_at` asks for (the PS calls it every `tick_s`, which the
dealer already rounds speculation to), so deadlines fire at their exact time here and up to one tick later
in the PS.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cleave import fanout
from cleave.dealer import BlockSend, Dealer, Policy, Recovery, Send, Work
from cleave.fleet import Fleet
from cleave.profile import streamed
from cleave.schemas import DeviceProfile
from cleave.sim.world import Profiles, World
from cleave.tiles import Tile

FINISH, CHECK, PLAN = 0, 1, 2  # event kinds


@dataclass(frozen=True)
class TileSet:
    """One GEMM cut as the PS cuts it: tiles, each tile's planned owner (a device id or None) and shape."""

    m: int
    n: int
    k: int
    b: int
    tiles: list[Tile]
    owners: list[str | None]
    egress_s: float = 0.0  # the planner's bound on the PS's egress time (the run charges what is sent)
    chunks: int = 1  # the plan's chunks: a worker's planned pieces may be this many in flight

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.m, self.n, self.k)


@dataclass
class PsLink:
    """The PS's egress: what it sends leaves one message after another at `bandwidth` bytes/s (None:
    unlimited), tiles direct and fan-out blocks once for their whole group, as the runtime sends them."""

    bandwidth: float | None = None
    free_at: float = 0.0
    sent: float = 0.0  # bytes

    def depart(self, now: float, nbytes: float) -> float:
        self.sent += nbytes
        if not self.bandwidth:
            return now
        self.free_at = max(now, self.free_at) + nbytes / self.bandwidth
        return self.free_at


@dataclass
class Outcome:
    """What one GEMM cost: its span, per-device traffic and work, and the ledger's counters."""

    start: float
    end: float
    down: dict[int, float]
    up: dict[int, float]
    tiles: int
    resent: int
    duplicates: int
    speculated: int
    recoveries: list[Recovery]
    plans_applied: int
    events: int = 0
    flops: float = 0.0  # of the accepted results: 2·rows·cols·k summed, m·n·k·2 once the GEMM is done
    last: dict[int, float] = field(default_factory=dict)  # per device, when its last result came
    accepted_at: dict[int, float] = field(default_factory=dict)  # per tile
    ps_bytes: float = 0.0  # what the PS sent for this GEMM
    ps_busy_s: float = 0.0  # from the start until the PS's link had sent it all

    @property
    def span(self) -> float:
        return self.end - self.start


def fleet_of(ids: Sequence[str], index: dict[str, int], declared: Profiles, cache_bytes: int,
             cache: dict[int, DeviceProfile] | None = None) -> list[tuple[str, int, DeviceProfile]]:
    """The dealer's view of simulated workers: (id, cache bytes, declared profile)."""
    cache = {} if cache is None else cache
    out = []
    for w in ids:
        d = index[w]
        if d not in cache:
            cache[d] = DeviceProfile.model_construct(
                flops=float(declared.flops[d]), memory_bytes=int(declared.mem[d]),
                downlink_bytes_per_s=float(declared.down[d]), uplink_bytes_per_s=float(declared.up[d]),
                latency_s=float(declared.lat[d]), declared=True)
        out.append((w, cache_bytes, cache[d]))
    return out


class GemmRun:
    """Simulate one GEMM from `start` until every tile is done (see the module docstring).

    `dealer` (the PS's, with its members) and `busy_until` (per device, when its downlink, compute and
    uplink are next free) and `link` (the PS's egress) carry over from GEMM to GEMM; `plans` are (time, the
    new plan's worker ids) applied when their time comes within this GEMM; `fleet` makes the dealer's members
    of ids. With `fan_out`, blocks several planned devices need are published once to all of them, as the PS
    does for workers that joined their group (here every planned device has)."""

    def __init__(self, ts: TileSet, start: float, dealer: Dealer, index: dict[str, int], actual: Profiles,
                 leave_at: np.ndarray, busy_until: np.ndarray, fleet, seq: int = 0,  # noqa: ANN001
                 plans: Sequence[tuple[float, tuple[str, ...]]] = (), link: PsLink | None = None,
                 fan_out: bool = True) -> None:
        self.ts, self.now, self.dealer, self.index = ts, start, dealer, index
        self.act, self.leave_at, self.busy, self.fleet = actual, leave_at, busy_until, fleet
        self.seq, self.plans = seq, list(plans)
        self.link = link or PsLink()
        self.fan_out = fan_out
        self.heap: list[tuple[float, int, int, tuple]] = []
        self.order = itertools.count()
        self.check_at = math.inf
        self.out = Outcome(start, start, {}, {}, len(ts.tiles), 0, 0, 0, [], 0)

    def run(self) -> Outcome:
        ts, d = self.ts, self.dealer
        for i, (t, ids) in enumerate(self.plans):
            self._push(max(t, self.now), PLAN, (i, ids))
        a_key, b_key = f"g{self.seq}a", f"g{self.seq}b"
        split, shared = fanout.layout(ts.tiles, ts.owners, a_key, b_key, ts.chunks) if self.fan_out else (None, None)
        if shared:
            for w, groups in fanout.memberships([(ts.tiles, ts.owners)], ts.chunks).items():
                d.join(w, groups)
        self.shared = shared or {}
        work = Work(self.seq, ts.m, ts.n, ts.k, ts.b, ts.tiles, ts.owners, ts.chunks, a_key, b_key, shared, split)
        sent_before = self.link.sent
        self._deliver(d.begin(work, self.now))
        while not d.complete:
            self._schedule_check()
            if not self.heap:
                raise RuntimeError(f"GEMM {ts.m}x{ts.n}: no worker left to finish it")
            self.now, _, kind, args = heapq.heappop(self.heap)
            self.out.events += 1
            if kind == FINISH:
                self._on_finish(*args)
            elif kind == CHECK:
                if self.now >= self.check_at - 1e-12:
                    self.check_at = math.inf
                    self._deliver(d.tick(self.now))
            else:
                self._on_plan(*args)
        led = self.ledger = d.ledger  # kept for the caller to inspect
        self.out.end = self.now
        self.out.ps_bytes = self.link.sent - sent_before
        self.out.ps_busy_s = max(0.0, self.link.free_at - self.out.start)
        self.out.resent, self.out.duplicates, self.out.speculated = led.resent, led.duplicates, led.speculated
        self.out.recoveries = list(d.recoveries)
        d.end()
        return self.out

    def _push(self, t: float, kind: int, args: tuple) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, args))

    def _schedule_check(self) -> None:
        at = self.dealer.next_check_at(self.now)
        if at < self.check_at - 1e-12:
            self.check_at = at
            self._push(at, CHECK, ())

    # ---- the devices -------------------------------------------------------------------------------
    def _deliver(self, sends: list[Send]) -> None:
        for s in sends:
            self._device(s)

    def _device(self, s: Send) -> None:
        """Tile `s` leaves the PS (after what it sent before), its shared blocks reach their whole group, and
        its device streams it through its links and compute."""
        d, t, ts, a = self.index[s.worker], s.tile, self.ts, self.act
        at = self.link.depart(self.now, s.nbytes + s.pushed)
        if at > self.now:
            self.dealer.departed(t.index, s.attempt, at)
        for leaf in (*s.a.leaves(), *s.b.leaves()):
            if leaf.publish:
                self._publish(leaf, (leaf.hi - leaf.lo) * ts.k * ts.b, at)
        if at >= self.leave_at[d]:
            return  # sent into the void: the device has left, the PS does not know yet
        up, flops = t.rows * t.cols * ts.b, 2.0 * t.rows * t.cols * ts.k
        clock = streamed(tuple(self.busy[d]), at, a.lat[d], s.nbytes / a.down[d], flops / a.flops[d], up / a.up[d])
        self.busy[d] = clock
        self.out.down[d] = self.out.down.get(d, 0.0) + s.nbytes
        if clock[2] < self.leave_at[d]:
            self._push(clock[2], FINISH, (s.worker, t.index, s.attempt))

    def _publish(self, block: BlockSend, nbytes: float, at: float) -> None:
        """A block published to its group: every member still there downloads it, in turn with its tiles."""
        name, members = self.shared[block.id]
        for w in members:
            d = self.index[w]
            if at < self.leave_at[d] and name in self.dealer.joined.get(w, ()):
                self.busy[d][0] = max(at + self.act.lat[d], self.busy[d][0]) + nbytes / self.act.down[d]
                self.out.down[d] = self.out.down.get(d, 0.0) + nbytes

    def _on_finish(self, w: str, tile: int, attempt: int) -> None:
        d, led, ts = self.index[w], self.dealer.ledger, self.ts
        t = led.tiles[tile]
        self.out.up[d] = self.out.up.get(d, 0.0) + t.rows * t.cols * ts.b
        self.out.last[d] = self.now
        outcome, sends = self.dealer.done(w, tile, attempt, self.now)
        if outcome == "accepted":
            self.out.flops += 2.0 * t.rows * t.cols * ts.k
            self.out.accepted_at[tile] = self.now
            up = led.parent.get(tile)
            while up is not None and led.covered(up):  # the last piece of a block cut when it was lost
                self.out.accepted_at[up] = self.now
                up = led.parent.get(up)
        self._deliver(sends)

    def _on_plan(self, i: int, ids: tuple[str, ...]) -> None:
        self.out.plans_applied = i + 1
        self._deliver(self.dealer.set_fleet(self.fleet(ids), self.now))


def play(sets: Sequence[TileSet], profiles: dict[str, DeviceProfile], caches: dict[str, int], window: int,
         fan_out: bool = True, rounds: int = 1) -> list[float]:
    """The span of each GEMM of `sets` in the last of `rounds` undisturbed rounds, each round the GEMMs one
    after another as a training step runs them, by one dealer with the PS's default policy and `window`
    (round trips, suspicions and busy devices carry over, as in the PS) on devices that keep their
    profiles: what `cleave.dealing` predicts with."""
    world = World.build(Fleet.of(profiles))
    members = [(w, caches[w], p) for w, p in profiles.items()]
    dealer = Dealer(Policy(window=window))
    dealer.set_fleet(members, 0.0)
    busy, now, seq, spans = np.zeros((len(world), 3)), 0.0, 0, []
    for _ in range(rounds):
        spans = []
        for ts in sets:
            seq += 1
            run = GemmRun(ts, now, dealer, world.index, world.actual, world.leave_at, busy,
                          lambda ids: [x for x in members if x[0] in set(ids)], seq, fan_out=fan_out)
            out = run.run()
            spans.append(out.span)
            now = out.end
    return spans
