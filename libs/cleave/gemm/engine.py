"""One GEMM, event by event: the PS's own dealing core (`cleave.gemm.dealer.Dealer`) deals tiles to simulated
devices that compute them at their actual pace, leave without notice, straggle, and get speculative copies
and re-sent tiles.

Every dealing decision is the dealer's, exactly as in the PS (`cleave_ps.fleet.dispatcher` is the other shell
around it); this module only plays the devices and the clock. A device streams its tiles as a worker that
paces itself to a declared profile does (`cleave.plan.profile.streamed`, the `Pacer`'s clock): downlink,
compute and uplink work on consecutive tiles in parallel, so a long run of tiles costs
`latency + max(down / downlink, up / uplink, flops / FLOPS)` and a lone tile the sum of its stages. A
device that has left receives nothing and answers nothing; the dealer notices by its deadline or when a
new plan (`plans`: time, the plan's worker ids) drops it. A worker back in the plan or back from suspicion
gets tiles once a link check (`CHECK_BYTES` down behind what its downlink still carries, a round trip) has
come back, as `cleave_ps.fleet.linkcheck` proves it; one that has left never answers.

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

from cleave.errors import FleetGone
from cleave.gemm import fanout
from cleave.gemm.dealer import (
    CHECK_BYTES,
    BlockSend,
    Dealer,
    Instruction,
    Policy,
    ProveLink,
    Recovery,
    Send,
    Work,
)
from cleave.gemm.ledger import GemmLedger
from cleave.gemm.tiles import Tile
from cleave.plan.fleet import Fleet, Profiles
from cleave.plan.profile import streamed
from cleave.schemas import DeviceProfile

FINISH, CHECK, PLAN, PROVED = 0, 1, 2, 3  # event kinds


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
    copied: int
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


class Engine:
    """GEMMs dealt by one dealer to simulated devices from `start` on, one or several at once (see the
    module docstring): `begin` a GEMM, `run_until` some are done, read each one's `Outcome` in `outcomes`.

    `dealer` (the PS's, with its members) and `busy_until` (per device, when its downlink, compute and
    uplink are next free) and `link` (the PS's egress) carry over from engine to engine; `plans` are (time,
    the new plan's worker ids) applied when their time comes (`add_plans` adds later ones), `plans_applied`
    counts those applied; `fleet` makes the dealer's members of ids. With `fan_out`, blocks several planned
    devices need are published once to all of them, as the PS does for workers that joined their group
    (here every planned device has). What a GEMM's devices still send after it is done is ignored, as the
    PS ignores results of a GEMM it ended."""

    def __init__(self, start: float, dealer: Dealer, index: dict[str, int], actual: Profiles,
                 leave_at: np.ndarray, busy_until: np.ndarray, fleet,  # noqa: ANN001
                 plans: Sequence[tuple[float, tuple[str, ...]]] = (), link: PsLink | None = None,
                 fan_out: bool = True, pending: Sequence[Instruction] = ()) -> None:
        self.now, self.dealer, self.index = start, dealer, index
        self.pending = list(pending)  # instructions the dealer gave between engines: carried out when play starts
        self.act, self.leave_at, self.busy, self.fleet = actual, leave_at, busy_until, fleet
        self.link = link or PsLink()
        self.fan_out = fan_out
        self.heap: list[tuple[float, int, int, tuple]] = []
        self.order = itertools.count()
        self.check_at = math.inf
        self.plans: list[tuple[float, tuple[str, ...]]] = []
        self.plans_applied = 0
        self.events = 0
        self.sets: dict[int, TileSet] = {}  # the GEMMs in flight, by seq
        self.outcomes: dict[int, Outcome] = {}  # every GEMM begun here, by seq (`end` set once it is done)
        self.ledgers: dict[int, GemmLedger] = {}  # ... and its ledger
        self.shared: dict[str, tuple[str, list[str]]] = {}  # fan-out block id -> (group, members)
        self.add_plans(plans)

    def add_plans(self, plans: Sequence[tuple[float, tuple[str, ...]]]) -> None:
        for t, ids in plans:
            self._push(max(t, self.now), PLAN, (len(self.plans), ids))
            self.plans.append((t, ids))

    def begin(self, ts: TileSet, seq: int, priority: int = 0) -> None:
        """Start dealing `ts` now, beside the GEMMs in flight (`Dealer.begin`'s `priority`)."""
        d = self.dealer
        a_key, b_key = f"g{seq}a", f"g{seq}b"
        split, shared = fanout.layout(ts.tiles, ts.owners, a_key, b_key, ts.chunks) if self.fan_out else (None, None)
        if shared:
            for w, groups in fanout.groups_of(shared).items():
                d.join(w, groups)
            self.shared.update(shared)
        self.sets[seq] = ts
        out = self.outcomes[seq] = Outcome(self.now, self.now, {}, {}, len(ts.tiles), 0, 0, 0, [], 0)
        out.ps_bytes, out.end = 0.0, math.nan
        work = Work(seq, ts.m, ts.n, ts.k, ts.b, ts.tiles, ts.owners, ts.chunks, a_key, b_key, shared, split)
        self.deliver(d.begin(work, self.now, priority))
        self.ledgers[seq] = d.deal(seq).ledger

    def run_until(self, seqs: Sequence[int]) -> None:
        """Play events until every GEMM of `seqs` is done (the others go on meanwhile)."""
        d = self.dealer
        self.deliver(self.pending)
        self.pending = []
        while any(s in self.sets for s in seqs):
            self._schedule_check()
            if not self.heap:
                left = ", ".join(f"{ts.m}x{ts.n}" for ts in self.sets.values())
                raise FleetGone(f"GEMM {left}: no worker left to finish it")
            self.now, _, kind, args = heapq.heappop(self.heap)
            self.events += 1
            if kind == FINISH:
                self._on_finish(*args)
            elif kind == CHECK:
                if self.now >= self.check_at - 1e-12:
                    self.check_at = math.inf
                    self.deliver(d.tick(self.now))
            elif kind == PLAN:
                self._on_plan(*args)
            else:
                self.deliver(d.proved(args[0], self.now))

    def _done(self, seq: int) -> None:
        led, out = self.ledgers[seq], self.outcomes[seq]
        out.end = self.now
        out.plans_applied = self.plans_applied
        out.ps_busy_s = max(0.0, self.link.free_at - out.start)
        out.resent, out.duplicates, out.copied = led.resent, led.duplicates, led.copied
        out.recoveries = list(self.dealer.deal(seq).recoveries)
        self.dealer.end(seq)
        del self.sets[seq]

    def _push(self, t: float, kind: int, args: tuple) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, args))

    def _schedule_check(self) -> None:
        at = self.dealer.next_check_at(self.now)
        if at < self.check_at - 1e-12:
            self.check_at = at
            self._push(at, CHECK, ())

    def _prove(self, w: str) -> None:
        """A link check the dealer asks for: its answer comes back after its bytes and a round trip."""
        d = self.index[w]
        at = max(self.now + self.act.lat[d], self.busy[d][0]) + CHECK_BYTES / self.act.down[d] + self.act.lat[d]
        if at < self.leave_at[d]:
            self._push(at, PROVED, (w,))

    # ---- the devices -------------------------------------------------------------------------------
    def deliver(self, instructions: Sequence[Instruction]) -> None:
        """Carry out what the dealer decided: tiles to the devices, link checks; losses and recoveries are
        read from the dealer's deals when a GEMM is done."""
        for i in instructions:
            if isinstance(i, Send):
                self._device(i)
            elif isinstance(i, ProveLink):
                self._prove(i.worker)

    def _device(self, s: Send) -> None:
        """Tile `s` leaves the PS (after what it sent before), its shared blocks reach their whole group, and
        its device streams it through its links and compute."""
        d, t, ts, a, out = self.index[s.worker], s.tile, self.sets[s.seq], self.act, self.outcomes[s.seq]
        sent = self.link.sent
        at = self.link.depart(self.now, s.nbytes + s.pushed)
        self.dealer.departed(t.index, s.attempt, at, s.seq)
        for leaf in (*s.a.leaves(), *s.b.leaves()):
            if leaf.publish:
                self._publish(leaf, (leaf.hi - leaf.lo) * ts.k * ts.b, at, out)
        out.ps_bytes += self.link.sent - sent
        if at >= self.leave_at[d]:
            return  # sent into the void: the device has left, the PS does not know yet
        up, flops = t.rows * t.cols * ts.b, 2.0 * t.rows * t.cols * ts.k
        clock = streamed(tuple(self.busy[d]), at, a.lat[d], s.nbytes / a.down[d], flops / a.flops[d], up / a.up[d])
        self.busy[d] = clock
        out.down[d] = out.down.get(d, 0.0) + s.nbytes
        if clock[2] < self.leave_at[d]:
            self._push(clock[2], FINISH, (s.worker, s.seq, t.index, s.attempt))

    def _publish(self, block: BlockSend, nbytes: float, at: float, out: Outcome) -> None:
        """A block published to its group: every member still there downloads it, in turn with its tiles."""
        name, members = self.shared[block.id]
        for w in members:
            d = self.index[w]
            if at < self.leave_at[d] and name in self.dealer.groups.joined.get(w, ()):
                self.busy[d][0] = max(at + self.act.lat[d], self.busy[d][0]) + nbytes / self.act.down[d]
                out.down[d] = out.down.get(d, 0.0) + nbytes

    def _on_finish(self, w: str, seq: int, tile: int, attempt: int) -> None:
        if seq not in self.sets or w not in self.dealer.members:
            return  # a result of a GEMM that is done, or from a worker no longer in the plan: the PS drops it
        d, led, ts, out = self.index[w], self.ledgers[seq], self.sets[seq], self.outcomes[seq]
        t = led.tiles[tile]
        out.up[d] = out.up.get(d, 0.0) + t.rows * t.cols * ts.b
        out.last[d] = self.now
        outcome, sends = self.dealer.done(w, tile, attempt, self.now, seq)
        if outcome == "accepted":
            out.flops += 2.0 * t.rows * t.cols * ts.k
            out.accepted_at[tile] = self.now
            up = led.parent.get(tile)
            while up is not None and led.covered(up):  # the last piece of a block cut when it was lost
                out.accepted_at[up] = self.now
                up = led.parent.get(up)
        self.deliver(sends)
        if outcome == "accepted" and self.dealer.is_complete(seq):
            self._done(seq)

    def _on_plan(self, i: int, ids: tuple[str, ...]) -> None:
        self.plans_applied = i + 1
        self.deliver(self.dealer.set_fleet(self.fleet(ids), self.now))


class OneGemm(Engine):
    """One GEMM alone from `start` until every tile is done (an `Engine` with one GEMM; `run` returns its
    `Outcome`, `ledger` its ledger), as the PS deals a GEMM when nothing else is in flight."""

    def __init__(self, ts: TileSet, start: float, dealer: Dealer, index: dict[str, int], actual: Profiles,
                 leave_at: np.ndarray, busy_until: np.ndarray, fleet, seq: int = 0,  # noqa: ANN001
                 plans: Sequence[tuple[float, tuple[str, ...]]] = (), link: PsLink | None = None,
                 fan_out: bool = True, pending: Sequence[Instruction] = ()) -> None:
        super().__init__(start, dealer, index, actual, leave_at, busy_until, fleet, plans, link, fan_out, pending)
        self.ts, self.seq = ts, seq

    def run(self) -> Outcome:
        self.begin(self.ts, self.seq)
        self.run_until([self.seq])
        self.ledger, self.out = self.ledgers[self.seq], self.outcomes[self.seq]
        self.out.events = self.events
        return self.out


def play(sets: Sequence[TileSet], profiles: dict[str, DeviceProfile], caches: dict[str, int], window: int,
         fan_out: bool = True, rounds: int = 1) -> list[float]:
    """The span of each GEMM of `sets` in the last of `rounds` undisturbed rounds, each round the GEMMs one
    after another as a training step runs them, by one dealer with the PS's default policy and `window`
    (round trips, suspicions and busy devices carry over, as in the PS) on devices that keep their
    profiles: what `cleave.gemm.predict` predicts with."""
    fleet = Fleet.of(profiles)
    index, actual = {d: i for i, d in enumerate(fleet.ids)}, Profiles.of_fleet(fleet)
    members = [(w, caches[w], p) for w, p in profiles.items()]
    dealer = Dealer(Policy(window=window))
    dealer.set_fleet(members, 0.0)
    busy, now, seq, spans = np.zeros((len(fleet), 3)), 0.0, 0, []
    for _ in range(rounds):
        spans = []
        for ts in sets:
            seq += 1
            run = OneGemm(ts, now, dealer, index, actual, np.full(len(fleet), math.inf), busy,
                          lambda ids: [x for x in members if x[0] in set(ids)], seq, fan_out=fan_out)
            out = run.run()
            spans.append(out.span)
            now = out.end
    return spans
