"""One GEMM, event by event: the PS's own tile ledger deals tiles to simulated devices that compute them
at the cost model's pace, leave without notice, straggle, and get speculative copies and re-sent tiles.

The dealing mirrors `cleave_ps.dispatcher` step for step, with simulated time in place of the event loop:
every live worker keeps up to `window` tiles in flight, or the plan's `chunks` while it has planned pieces
left (round-robin at the start, one more per result);
a worker idle with nothing left to take gets a copy of a tile that runs past `speculate_factor` usual round
trips; a worker silent past its deadline is presumed lost and `GemmLedger.give_back` re-queues its tiles;
a new plan adds workers and drops those it no longer lists. A device streams its tiles at its actual speed
as a worker that paces itself to a declared profile does (`cleave.profile.streamed`, the `Pacer`'s clock):
downlink, compute and uplink work on consecutive tiles in parallel, so a long run of tiles costs
`latency + max(down / downlink, up / uplink, flops / FLOPS)` and a lone tile the sum of its stages.

Where it differs from the dispatcher: a worker's deadline is at least `timeout_factor` x its oldest tile's
predicted time (the dispatcher's: x the GEMM's planned makespan), and before any result on a GEMM shape the
usual round trip is the median predicted tile time (the dispatcher uses `tile_timeout_s`); both keep
round-trip averages per worker and GEMM shape. A result from an earlier GEMM never reaches a later one here; the dispatcher counts it
as late and clears its worker's suspicion.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cleave.ledger import DEFAULT_WINDOW, GemmLedger
from cleave.profile import streamed
from cleave.sim.world import Profiles
from cleave.tiles import Tile

FINISH, CHECK, SPEC, PLAN = 0, 1, 2, 3  # event kinds


def ledger_class() -> Any:
    """The PS's `GemmLedger` (`cleave.ledger`): the simulator deals tiles with the very code the PS runs."""
    return GemmLedger


@dataclass(frozen=True)
class PsPolicy:
    """The PS's dealing knobs; the defaults are `cleave_ps.settings.PsSettings`' and the worker's."""

    window: int = DEFAULT_WINDOW  # tiles in flight per worker
    tile_timeout_s: float = 1.0  # a worker silent this long with tiles in flight is presumed lost ...
    timeout_factor: float = 4.0  # ... or this many times its usual tile time, if longer
    speculate_factor: float = 3.0  # copy a tile running this many usual round trips; 0 = never
    speculate_min_s: float = 0.2  # ... and at least this long
    tick_s: float = 0.05  # the PS's progress check; the smallest gap between speculation checks
    cache_bytes: int = 128 * 1024**2  # the worker's input-block cache, mirrored by the PS


@dataclass
class Slot:
    """The PS's view of one worker (`cleave_ps.dispatcher.WorkerSlot`)."""

    rt: dict[tuple, float] = field(default_factory=dict)  # moving average of send-to-result s, per GEMM shape
    last_progress: float = 0.0
    suspect: bool = False
    known: OrderedDict[tuple, int] = field(default_factory=OrderedDict)  # cached input blocks -> bytes
    known_bytes: int = 0
    token: int = 0  # invalidates stale deadline checks


@dataclass(frozen=True)
class TileSet:
    """One GEMM cut as the PS cuts it: tiles, each tile's planned owner (a device id or None) and shape."""

    m: int
    n: int
    k: int
    b: int
    tiles: list[Tile]
    owners: list[str | None]
    egress_s: float = 0.0  # the PS's egress floor for this GEMM (0 when unlimited)
    typical_s: float = 0.0  # the median predicted tile time: the usual round trip before any result
    chunks: int = 1  # the plan's chunks: a worker's planned pieces may be this many in flight

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.m, self.n, self.k)


@dataclass
class Recovery:
    """A worker presumed lost: its tiles, when the PS noticed, and when the last of them was done."""

    device: str
    cause: str
    lost_at: float  # when it stopped making progress (as the PS saw it)
    detected_at: float
    tiles: set[int]
    count: int
    done_at: float | None = None


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

    @property
    def span(self) -> float:
        return self.end - self.start


class GemmRun:
    """Simulate one GEMM from `start` until every tile is done (see the module docstring).

    `slots` (the PS's workers, in plan order) and `busy_until` (per device, when its downlink, compute and
    uplink are next free: `cleave.profile.streamed`) carry over from GEMM to GEMM;
    `plans` are (time, the new plan's worker ids) applied when their time comes within this GEMM."""

    def __init__(
        self,
        ts: TileSet,
        start: float,
        slots: dict[str, Slot],
        index: dict[str, int],
        declared: Profiles,
        actual: Profiles,
        leave_at: np.ndarray,
        busy_until: np.ndarray,
        policy: PsPolicy,
        plans: Sequence[tuple[float, tuple[str, ...]]] = (),
    ) -> None:
        self.ts, self.now, self.slots, self.index = ts, start, slots, index
        self.dec, self.act, self.leave_at, self.busy = declared, actual, leave_at, busy_until
        self.p, self.plans = policy, list(plans)
        self.ledger = ledger_class()(ts.tiles, [o if o in slots else None for o in ts.owners])
        for slot in slots.values():  # block ids are per input tensor: nothing cached hits in another GEMM
            slot.known.clear()
            slot.known_bytes = 0
        self.heap: list[tuple[float, int, int, tuple]] = []
        self.seq = itertools.count()
        self.spec_at = math.inf
        self.idle: set[str] = set()  # live workers with nothing in flight
        self.recoveries: list[Recovery] = []
        self.out = Outcome(start, start, {}, {}, len(ts.tiles), 0, 0, 0, [], 0)
        self._usual: tuple[float, float] | None = None  # (median round trip, when computed)

    # ---- the event loop ----------------------------------------------------------------------------
    def run(self) -> Outcome:
        for i, (t, ids) in enumerate(self.plans):
            self._push(max(t, self.now), PLAN, (i, ids))
        self._fill_all()
        while not self.ledger.complete:
            if not self.heap:
                raise RuntimeError(f"GEMM {self.ts.m}x{self.ts.n}: no worker left to finish it")
            self.now, _, kind, args = heapq.heappop(self.heap)
            self.out.events += 1
            if kind == FINISH:
                self._on_finish(*args)
            elif kind == CHECK:
                self._on_check(*args)
            elif kind == SPEC:
                self._on_spec()
            else:
                self._on_plan(*args)
        led = self.ledger
        self.out.end = max(self.now, self.out.start + self.ts.egress_s)
        self.out.resent, self.out.duplicates, self.out.speculated = led.resent, led.duplicates, led.speculated
        self.out.recoveries = self.recoveries
        return self.out

    def _push(self, t: float, kind: int, args: tuple) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, args))

    # ---- dealing (dispatcher._fill_all, _fill, _speculate, _send) --------------------------------------
    def _live(self) -> list[str]:
        return [w for w, s in self.slots.items() if not s.suspect]

    def _fill_all(self) -> None:
        for depth in range(1, max(self.p.window, self.ts.chunks) + 1):
            for w in self._live():
                self._fill(w, depth)
        self._schedule_spec()

    def _fill(self, w: str, depth: int | None = None) -> None:
        slot = self.slots.get(w)
        if slot is None or slot.suspect:
            return
        led = self.ledger
        while led.count(w) < min(depth or math.inf, led.room(w, self.p.window, self.ts.chunks)):
            att = led.take(w, self.now, self._score(slot)) if led.dealable() else None
            if att is None:
                att = self._speculate(w)
            if att is None:
                break
            if led.count(w) == 1:
                slot.last_progress = self.now  # the clock of an idle worker starts now
                self._send(w, att.tile, att.attempt)
                self._arm(w)
            else:
                self._send(w, att.tile, att.attempt)
        self._mark(w)

    def _mark(self, w: str) -> None:
        if self.ledger.count(w) or w not in self.slots or self.slots[w].suspect:
            self.idle.discard(w)
        else:
            self.idle.add(w)

    def _score(self, slot: Slot) -> Any:
        if not slot.known:
            return None
        return lambda t: (
            (("a", t.r0, t.r1) in slot.known) * t.rows + (("b", t.c0, t.c1) in slot.known) * t.cols
        )

    def _usual_rt(self) -> float:
        """The median worker round trip for this GEMM's shape, or the median predicted tile time before any
        (recomputed at most once per tick: the PS sorts them every call)."""
        if self._usual is None or self.now - self._usual[1] >= self.p.tick_s:
            key = self.ts.key
            trips = [r for s in self.slots.values() if (r := s.rt.get(key, 0.0)) > 0]
            first = self.ts.typical_s or self.p.tile_timeout_s
            self._usual = (float(np.median(trips)) if trips else first, self.now)
        return self._usual[0]

    def _oldest_single(self) -> Any:
        """The oldest attempt running with no twin (what `GemmLedger.speculate` would copy), or None."""
        led = self.ledger
        return next((a for a in led.running.values() if len(led.by_tile[a.tile]) == 1), None)

    def _threshold(self) -> float:
        return max(self.p.speculate_min_s, self.p.speculate_factor * self._usual_rt())

    def _speculate(self, w: str) -> Any:
        if self.p.speculate_factor <= 0 or self.ledger.count(w):
            return None
        oldest, age = self._oldest_single(), self._threshold()
        if oldest is None or self.now - oldest.sent_at <= age:
            return None  # what the ledger would answer, without its scan of every running tile
        return self.ledger.speculate(w, self.now, age)

    def _block(self, slot: Slot, key: tuple, nbytes: int) -> int:
        """Bytes sent for one input block: none if the worker caches it (`_block` / `remember`)."""
        if key in slot.known:
            slot.known.move_to_end(key)
            return 0
        if nbytes <= self.p.cache_bytes:
            while slot.known_bytes + nbytes > self.p.cache_bytes:
                slot.known_bytes -= slot.known.popitem(last=False)[1]
            slot.known[key] = nbytes
            slot.known_bytes += nbytes
        return nbytes

    def _send(self, w: str, tile: int, attempt: int) -> None:
        t, ts, slot = self.ledger.tiles[tile], self.ts, self.slots[w]
        down = self._block(slot, ("a", t.r0, t.r1), t.rows * ts.k * ts.b)
        down += self._block(slot, ("b", t.c0, t.c1), t.cols * ts.k * ts.b)
        d = self.index[w]
        if self.now >= self.leave_at[d]:
            return  # sent into the void: the device has left, the PS does not know yet
        a = self.act
        up, flops = t.rows * t.cols * ts.b, 2.0 * t.rows * t.cols * ts.k
        clock = streamed(tuple(self.busy[d]), self.now, a.lat[d], down / a.down[d], flops / a.flops[d], up / a.up[d])
        self.busy[d] = clock
        self.out.down[d] = self.out.down.get(d, 0.0) + down
        if clock[2] < self.leave_at[d]:
            self._push(clock[2], FINISH, (w, tile, attempt, self.now))

    # ---- results (dispatcher.on_result) -------------------------------------------------------------------
    def _on_finish(self, w: str, tile: int, attempt: int, sent_at: float) -> None:
        d, t = self.index[w], self.ledger.tiles[tile]
        self.out.up[d] = self.out.up.get(d, 0.0) + t.rows * t.cols * self.ts.b
        self.out.last[d] = self.now
        slot, led = self.slots.get(w), self.ledger
        if slot is not None:
            if (tile, attempt) in led.running:
                rt, old = self.now - sent_at, slot.rt.get(self.ts.key, 0.0)
                slot.rt[self.ts.key] = rt if old == 0 else 0.8 * old + 0.2 * rt
            slot.last_progress, slot.suspect = self.now, False
        twins = [led.running[(tile, a)].worker for a in led.by_tile.get(tile, ()) if a != attempt]
        if led.finish(tile, attempt) == "accepted":
            self.out.flops += 2.0 * t.rows * t.cols * self.ts.k
            self.out.accepted_at[tile] = self.now
            up = led.parent.get(tile)
            while up is not None and led.covered(up):  # the last piece of a block cut when it was lost
                self.out.accepted_at[up] = self.now
                up = led.parent.get(up)
            for other in twins:  # the ledger dropped a speculative twin too
                self._mark(other)
            self._close_recoveries(tile)
        if self.ledger.complete:
            return
        if slot is not None:
            self._fill(w)
            if led.count(w):
                self._arm(w)
        self._schedule_spec()

    # ---- lost workers (dispatcher._check_progress, _lose, set_plan) -----------------------------------------
    def _deadline(self, w: str) -> float:
        """max(tile_timeout_s, timeout_factor x the worker's usual tile time), the usual time being the larger
        of its round trips on this GEMM shape and the predicted time of its oldest tile."""
        d, ts, p = self.index[w], self.ts, self.dec
        t = self.ledger.tiles[self._oldest(w)[0]]
        predicted = p.lat[d] + max(
            (t.rows + t.cols) * ts.k * ts.b / p.down[d],
            t.rows * t.cols * ts.b / p.up[d],
            2.0 * t.rows * t.cols * ts.k / p.flops[d],
        )
        usual = max(self.slots[w].rt.get(ts.key, 0.0), predicted)
        return max(self.p.tile_timeout_s, self.p.timeout_factor * usual)

    def _oldest(self, w: str) -> tuple[int, float]:
        """(tile, sent_at) of the worker's oldest attempt in flight."""
        oldest = min(self.ledger.by_worker[w].values(), key=lambda a: a.sent_at)
        return oldest.tile, oldest.sent_at

    def _since(self, w: str) -> float:
        return max(self.slots[w].last_progress, self._oldest(w)[1])

    def _arm(self, w: str) -> None:
        slot = self.slots[w]
        slot.token += 1
        self._push(self._since(w) + self._deadline(w), CHECK, (w, slot.token))

    def _on_check(self, w: str, token: int) -> None:
        slot = self.slots.get(w)
        if slot is None or slot.token != token or slot.suspect or not self.ledger.count(w):
            return
        since = self._since(w)
        if self.now - since < self._deadline(w) - 1e-9:
            self._arm(w)
            return
        slot.suspect = True
        self._lose(w, "tile_deadline", since)
        self._fill_all()

    def _lose(self, w: str, cause: str, since: float) -> None:
        self.idle.discard(w)
        lost = self.ledger.give_back(w, self.ts.chunks)
        if lost:
            self.recoveries.append(Recovery(w, cause, since, self.now, set(lost), len(lost)))

    def _on_plan(self, i: int, ids: tuple[str, ...]) -> None:
        keep = set(ids)
        for w in ids:
            if w not in self.slots:
                self.slots[w] = Slot(last_progress=self.now)
        for gone in [w for w in self.slots if w not in keep]:
            self._lose(gone, "heartbeat_timeout", self.slots[gone].last_progress)
            del self.slots[gone]
        self.out.plans_applied = i + 1
        self._fill_all()

    def _close_recoveries(self, tile: int) -> None:
        for rec in self.recoveries:
            if rec.done_at is None and tile in rec.tiles:
                rec.tiles.discard(tile)
                if not rec.tiles:
                    rec.done_at = self.now

    # ---- speculation checks: an idle worker gets a copy once a tile has run past the threshold ---------------
    def _schedule_spec(self) -> None:
        if self.p.speculate_factor <= 0 or not self.ledger.running or not self.idle:
            return
        oldest = self._oldest_single()
        if oldest is None:
            return
        at = max(oldest.sent_at + self._threshold(), self.now + self.p.tick_s)
        if at < self.spec_at - 1e-12:
            self.spec_at = at
            self._push(at, SPEC, ())

    def _on_spec(self) -> None:
        if self.now < self.spec_at - 1e-12:
            return  # superseded by an earlier check
        self.spec_at = math.inf
        for w in [w for w in self.slots if w in self.idle]:
            before = self.ledger.speculated
            self._fill(w)
            if self.ledger.speculated == before and not self.ledger.count(w):
                break  # nothing is old enough for anyone
        self._schedule_spec()
