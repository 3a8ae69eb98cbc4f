"""The dealing of GEMM tiles to a fleet: one pure object that the PS and the simulator both drive.

Several GEMMs may be dealt at once (`begin` with a priority: the PS deals a layer's weight gradient beside
the input gradients on the critical path, so that its tiles fill their tails); a worker takes the next tile
of the first GEMM, in priority order, that has one for it, and its room is counted over all of them.
It decides everything about a GEMM's dealing: which tile goes to which worker next (its planned pieces
first, then shared tiles with cached inputs first, then, once idle, a tile stolen from the device with the
most left), which input blocks travel with a tile and which the worker caches (`inputs`), how much a worker
may have in flight (tiles and bytes), when a worker that makes no progress is presumed lost and its tiles
given back, cut for several devices (`deadlines`), when a straggling tile is copied to an idle worker
(`copies`), and when a suspect worker is tried again.

It does no I/O and keeps no clock: every call takes `now` and returns what the caller is to do, in one
channel (as dask's worker state machine: events in, instructions out): tiles to send (`Send`), links to
prove (`ProveLink`), workers presumed lost (`WorkerLost`), tiles lost with them (`TilesLost`) and losses
made good (`RecoveryDone`). Every event costs O(log n) in workers and tiles: deadlines, suspicions and lone
attempts are kept in heaps, the round trips of a GEMM shape in a sorted list (their median), and only
workers that asked for work and found none are offered new work when some appears.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from cleave.gemm.dealer import copies, deadlines, inputs, trips
from cleave.gemm.dealer.model import (
    LEFT_KEPT,
    Deal,
    Instruction,
    Member,
    Policy,
    ProveLink,
    Recovery,
    RecoveryDone,
    Send,
    TilesLost,
    Work,
    WorkerLost,
)
from cleave.gemm.fanout import a_id, b_id
from cleave.gemm.ledger import Attempt, GemmLedger
from cleave.schemas import DeviceProfile


class Dealer:
    """Deals GEMMs, one or several at once, to a changing set of members (see the module docstring).

    The caller tells it what happens (`set_fleet`, `remove`, `proved`, `begin`, `done`, `failed`, `discard`,
    `redo`, `heard`, `departed`, `tick`, `end`) and carries out the instructions each call returns, in order; `next_check_at` says when `tick` next has something to do. Calls
    about a GEMM name it by `seq` (`Work.seq`, also on every `Send`); with one GEMM in flight it may be left out."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.p = policy or Policy()
        self.members: dict[str, Member] = {}
        self.deals: dict[int, Deal] = {}  # the GEMMs in flight, by seq
        self._ranked: list[Deal] = []  # ... in dealing order (priority, then seq)
        self._notes: list[Instruction] = []  # what the current call tells beside its sends (returned with them)
        self._hungry: dict[str, None] = {}  # live members that asked for work and found none (in order)
        self._idle: dict[str, None] = {}  # ... of which those with nothing in flight
        self._clock = deadlines.Deadlines(self.p)  # when members owe results, when suspects are tried again
        self._rts = trips.RoundTrips()  # each member's round trip per GEMM shape, and their median
        self.groups = inputs.Groups()  # the fan-out groups each worker is in
        self._left: OrderedDict[str, None] = OrderedDict()  # workers that left (the latest LEFT_KEPT)
        self.copies = copies.Copies(self.p, self._rts)  # when a late tile is copied to an idle worker

    # ---- the GEMMs in flight -----------------------------------------------------------------------
    def deal(self, seq: int | None = None) -> Deal:
        """The GEMM `seq` in flight (without `seq`: the only one)."""
        if seq is None:
            if len(self.deals) != 1:
                raise ValueError(f"{len(self.deals)} GEMMs in flight: say which (seq)")
            return self._ranked[0]
        return self.deals[seq]

    def _only(self) -> Deal | None:
        return self._ranked[0] if len(self._ranked) == 1 else None

    @property
    def complete(self) -> bool:
        only = self._only()
        return only is not None and only.ledger.complete

    def is_complete(self, seq: int) -> bool:
        deal = self.deals.get(seq)
        return deal is not None and deal.ledger.complete

    def _out(self, sends: list[Send]) -> list[Instruction]:
        """A call's instructions: its sends, then what else it decided (losses, links to prove, recoveries)."""
        notes, self._notes = self._notes, []
        return [*sends, *notes]

    # ---- the fleet ---------------------------------------------------------------------------------
    def set_fleet(self, fleet: Iterable[tuple[str, int, DeviceProfile | None]], now: float,
                  cause: str = "heartbeat_timeout") -> list[Instruction]:
        """The members are now exactly `fleet` (id, cache bytes, profile): newcomers join (one that was here
        before proves its link first), the others are lost (their tiles given back)."""
        fleet = list(fleet)
        for wid, cache, profile in fleet:
            m = self.members.get(wid)
            if m is None:
                back = self._left.pop(wid, 0) is None  # it was here before, and left
                self.members[wid] = Member(wid, cache, profile, last_progress=now, proven=not back)
                if back:
                    self._notes.append(ProveLink(wid))
            else:
                m.cache_bytes, m.profile = cache, profile
        keep = {wid for wid, _, _ in fleet}
        for gone in [w for w in self.members if w not in keep]:
            self._remove(gone, now, cause)
        return self._out(self._offer(now, self.members))

    def join(self, worker: str, groups: Iterable[str]) -> None:
        """`worker` has subscribed to `groups`, and keeps those of its previous join (`JOINS_KEPT`: a GEMM in
        flight when a plan changes goes on with the groups it began with); it left any older ones."""
        self.groups.join(worker, groups)

    def remove(self, worker: str, now: float, cause: str) -> list[Instruction]:
        """`worker` is gone for good (left the plan, or caught lying): its tiles are given back."""
        self._remove(worker, now, cause)
        return self._out([])

    def _remove(self, worker: str, now: float, cause: str) -> None:
        m = self.members.get(worker)
        if m is None:
            return
        self._lose(m, now, cause, m.last_progress)
        self._rts.forget(m)
        self.groups.forget(worker)
        del self.members[worker]
        self._left[worker] = None
        while len(self._left) > LEFT_KEPT:
            self._left.popitem(last=False)

    def proved(self, worker: str, now: float) -> list[Instruction]:
        """A round trip over `worker`'s downlink succeeded (`ProveLink`): it is dealt tiles again."""
        m = self.members.get(worker)
        if m is None or m.proven:
            return self._out([])
        m.proven, m.last_progress = True, now
        return self._out(self._offer(now, [worker]))

    # ---- one GEMM ----------------------------------------------------------------------------------
    def begin(self, work: Work, now: float, priority: int = 0) -> list[Instruction]:
        """Start dealing `work` beside the GEMMs already in flight: a worker takes its tiles when no GEMM of
        a lower `priority` (or begun earlier at the same one) has a tile for it. Every live member with room
        gets a tile of it before any gets a second."""
        # the planned tiles of a member presumed lost (suspect, still in the plan) are anyone's from the start
        live = {w for w, m in self.members.items() if not m.suspect}
        owners = [o if o in live else None for o in work.owners] if work.owners else None
        if not self.deals:  # nothing in flight: no byte, deadline or hunger of an earlier GEMM is left
            self._hungry, self._idle = {}, {}
            self._clock.clear()
            for m in self.members.values():
                m.inflight_bytes = 0
        deal = Deal(work, GemmLedger(work.tiles, owners), priority, trips.median_predicted(self.members, work, owners))
        self.deals[work.seq] = deal
        self._ranked = sorted(self.deals.values(), key=lambda d: d.rank)
        out: list[Send] = []
        for depth in range(1, max(self.p.window, work.chunks) + 1):
            for m in list(self.members.values()):
                out += self._fill(m, now, depth)
        return self._out(out)

    def end(self, seq: int | None = None) -> None:
        """The GEMM is over (done, or abandoned): nothing of it is dealt any more, and what it still had in
        flight no longer counts against its workers."""
        deal = self.deal(seq) if seq is None else self.deals.get(seq)
        if deal is None:
            return
        for key, nbytes in deal.bytes.items():
            att = deal.ledger.running.get(key)
            if att is not None and att.worker in self.members:
                self.members[att.worker].inflight_bytes -= nbytes
        del self.deals[deal.work.seq]
        self._ranked.remove(deal)
        if not self.deals:
            self._hungry, self._idle = {}, {}
            self._clock.clear()

    def extra(self, tile: int, worker: str, now: float, seq: int | None = None) -> Send:
        """One more attempt of `tile` on `worker` whose result is not assembled (a verification copy)."""
        deal = self.deal(seq)
        return self._send(deal, self.members[worker], deal.ledger.issue_extra(tile, worker, now), now)

    # ---- results -----------------------------------------------------------------------------------
    def done(self, worker: str, tile: int, attempt: int, now: float,
             seq: int | None = None) -> tuple[str, list[Instruction]]:
        """A valid block for (tile, attempt) from `worker`: "accepted" (the first), "duplicate" or
        "unknown"; returns the outcome and the instructions."""
        deal = self.deal(seq)
        led = deal.ledger
        m = self._progress(deal, worker, tile, attempt, now)
        others = [led.running[(tile, a)].worker for a in led.by_tile.get(tile, ()) if a != attempt]
        for a in list(led.by_tile.get(tile, ())):
            self._release(deal, tile, a)
        outcome = led.finish(tile, attempt)
        out: list[Send] = []
        if outcome == "accepted":
            self._notes += [RecoveryDone(rec) for rec in deal.closed(tile, now)]
            out = self._beaten(others, now)
            if m is not None:
                m.beaten = 0
        if led.complete and len(self.deals) == 1:
            return outcome, self._out([])
        out += self._fill(m, now) if m is not None else []
        for other in others:  # a copy was dropped: its worker has room again
            if other in self.members:
                out += self._fill(self.members[other], now)
        return outcome, self._out(out)

    def _beaten(self, others: list[str], now: float) -> list[Send]:
        """Another attempt finished first: a worker beaten `beaten_limit` times in a row is suspect, as one
        that missed a deadline (its tiles given back, tried again later)."""
        out: list[Send] = []
        for wid in others:
            m = self.members.get(wid)
            if m is None or m.suspect:
                continue
            m.beaten += 1
            if self.p.beaten_limit and m.beaten >= self.p.beaten_limit:
                m.beaten = 0
                self._suspect(m, now, "duplicates", m.last_progress)
                out += self._offer(now, list(self._hungry))
        return out

    def failed(self, worker: str, tile: int, attempt: int, now: float, missing: Sequence[str] = (),
               seq: int | None = None) -> list[Instruction]:
        """(tile, attempt) will not produce a block: the worker lacked cached `missing` blocks (it gets the
        tile again, with them), or it refused the tile (it goes to another worker, unless every live member
        has refused it: then they all try again). The tile goes to the front of the queue."""
        deal = self.deal(seq)
        m = self._progress(deal, worker, tile, attempt, now)
        if m is not None:
            for block_id in missing:
                m.forget(block_id)
                deal.inline.add((worker, block_id))  # not from its group again: it may have missed it
        self._release(deal, tile, attempt)
        deal.ledger.retry(tile, attempt)
        if missing:
            return self._out(self._offer(now, [worker]))
        refused = deal.refused.setdefault(tile, set())
        refused.add(worker)
        if all(w in refused for w, m in self.members.items() if not m.suspect):
            refused.clear()  # nobody else can: do not leave the tile undealt
        return self._out(self._offer(now, [*self._hungry, worker]))

    def discard(self, worker: str, tile: int, attempt: int, now: float, seq: int | None = None) -> list[Instruction]:
        """(tile, attempt) answered, but its block is not assembled here (a verification copy)."""
        deal = self.deal(seq)
        m = self._progress(deal, worker, tile, attempt, now)
        self._release(deal, tile, attempt)
        deal.ledger.drop(tile, attempt)
        return self._out(self._fill(m, now) if m is not None else [])

    def departed(self, tile: int, attempt: int, at: float, seq: int | None = None) -> None:
        """A send left the PS at `at` (later than dealt: behind others on the PS's link; the simulator says
        when it will): the worker owes its result, and the tile's age for a copy counts, from then. No copy
        is dealt while a send is still to leave: it would queue behind them on the link it slows."""
        deal = self.deals.get(seq) if seq is not None else self._only()
        self.copies.departed(deal, tile, attempt, at)
        if deal is not None:
            deal.ledger.departed(tile, attempt, at)

    def redo(self, worker: str, now: float) -> list[Instruction]:
        """What `worker` has in flight will not be heard of (its results were dropped unread): deal it again."""
        if not self.deals:
            return self._out([])
        for deal in self._ranked:
            for att in deal.ledger.inflight(worker):
                self._release(deal, att.tile, att.attempt)
                deal.ledger.retry(att.tile, att.attempt)
        return self._out(self._offer(now, [*self._hungry, worker]))

    def heard(self, worker: str) -> None:
        """`worker` answered for a GEMM that is over: it is alive."""
        if worker in self.members:
            self.members[worker].suspect = False

    def racing(self, tile: int, seq: int | None = None) -> list[Attempt]:
        """The attempts of `tile` still running (the first to deliver wins)."""
        deal = self.deals.get(seq) if seq is not None else self._only()
        led = deal.ledger if deal is not None else None
        return [led.running[(tile, a)] for a in sorted(led.by_tile.get(tile, ()))] if led is not None else []

    # ---- time --------------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Instruction]:
        """Suspects whose retry time came prove their link again (`ProveLink`), workers past their deadline are
        presumed lost, their tiles dealt to whoever has room, and idle workers copy tiles that run far too long."""
        if not self.deals:
            return self._out([])
        out: list[Send] = []
        self._notes += [ProveLink(wid) for wid in self._clock.retried(now, self.members)]
        for m, since in self._clock.late(now, self.members, self._ranked, self._count):
            self._suspect(m, now, "tile_deadline", since)
        if any(d.ledger.queued for d in self._ranked):
            out += self._offer(now, list(self._hungry))
        return self._out(out + self._copy_to_idle(now))

    def next_check_at(self, now: float) -> float:
        """When `tick` next may change something (deadlines exactly; copies at most once per `tick_s`)."""
        at = self._clock.next_at()
        return min(at, self.copies.due(self._ranked, now)) if self._idle else at

    # ---- dealing -----------------------------------------------------------------------------------
    def _fill(self, m: Member, now: float, depth: int | None = None) -> list[Send]:
        """Give `m` tiles up to its room (and `depth`): planned, shared, stolen, or a copy once idle, from
        the first GEMM in dealing order that has one for it."""
        w, out = m.id, []
        if not self._ranked or m.suspect or not m.proven or w not in self.members:
            return out
        hungry, count = False, self._count(w)
        while True:
            if count and m.over_budget(self.p.max_inflight_bytes):
                break
            deal, att = self._take(m, now, count, depth)
            copy = att is None and not count
            if copy:
                deal, att = self.copies.take(self._ranked, m.id, now)
            if att is None:
                hungry = self._room(m, count, depth)
                break
            count += 1
            if count == 1:
                m.last_progress = now  # the clock of an idle worker starts now
            out.append(self._send(deal, m, att, now, copy))
        self._mark(m, hungry, count)
        if out or count:
            self._clock.arm(m, self._ranked)
        return out

    def _take(self, m: Member, now: float, count: int, depth: int | None) -> tuple[Deal | None, Attempt | None]:
        """The next tile for `m` from the first GEMM that has room for it (its pieces stream `chunks` at
        once where it has planned tiles, else `window`) and a tile to give."""
        cap = depth or math.inf
        for deal in self._ranked:
            led = deal.ledger
            if led.complete or not led.dealable() or count >= min(cap, led.room(m.id, self.p.window, deal.work.chunks)):
                continue
            att = led.take(m.id, now, inputs.score(deal, m), self._avoid(deal, m.id), busy=count > 0)
            if att is not None:
                return deal, att
        return None, None

    def _room(self, m: Member, count: int, depth: int | None) -> bool:
        """Whether `m` could take another tile (it found none: it is hungry)."""
        rooms = [d.ledger.room(m.id, self.p.window, d.work.chunks) for d in self._ranked if not d.ledger.complete]
        cap = min(depth or math.inf, max(rooms, default=0))
        return count < cap

    def _count(self, worker: str) -> int:
        """Attempts running on `worker`, over every GEMM in flight."""
        return sum(d.ledger.count(worker) for d in self._ranked)

    @staticmethod
    def _avoid(deal: Deal, worker: str) -> set[int]:
        """The tiles `worker` refused in this GEMM."""
        return {t for t, who in deal.refused.items() if worker in who} if deal.refused else set()

    def _mark(self, m: Member, hungry: bool, count: int) -> None:
        for group, member in ((self._hungry, hungry), (self._idle, hungry and not count)):
            if member:
                group[m.id] = None
            else:
                group.pop(m.id, None)

    def _offer(self, now: float, ids: Iterable[str]) -> list[Send]:
        """Work appeared in a shared queue: members in `ids` take what they have room for."""
        out: list[Send] = []
        if not self.deals:
            return out
        for wid in ids:
            m = self.members.get(wid)
            if m is not None:
                out += self._fill(m, now)
        return out

    def _copy_to_idle(self, now: float) -> list[Send]:
        """Idle workers copy late tiles, while some are late enough and the PS's link allows copies."""
        out: list[Send] = []
        c = self.copies
        if not c.on or not self._idle or c.blocked(self._ranked, now) or not c.stale(self._ranked, now):
            return out
        for wid in list(self._idle):
            before = self._copies_made()
            out += self._fill(self.members[wid], now)
            if self._copies_made() == before:
                break  # nothing is old enough for anyone
        return out

    def _copies_made(self) -> int:
        return sum(d.ledger.copied for d in self._ranked)

    def _send(self, deal: Deal, m: Member, att: Attempt, now: float, copy: bool = False) -> Send:
        work, t = deal.work, deal.ledger.tiles[att.tile]
        joined = self.groups.joined
        a = inputs.block_input(deal, m, a_id(work.a_key, t), t.r0, t.r1, joined, self.members)
        b = inputs.block_input(deal, m, b_id(work.b_key, t), t.c0, t.c1, joined, self.members)
        nbytes = (a.rows("data") + b.rows("data")) * work.k * work.b
        pushed = (a.rows("publish") + b.rows("publish")) * work.k * work.b
        m.inflight_bytes += nbytes + pushed
        deal.sent(att.tile, att.attempt, nbytes + pushed, copy, now)
        return Send(m.id, t, att.attempt, a, b, nbytes, pushed, work.seq)

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _progress(self, deal: Deal, worker: str, tile: int, attempt: int, now: float) -> Member | None:
        """`worker` answered (tile, attempt): its round trip, progress clock and suspicion."""
        m = self.members.get(worker)
        if m is None:
            return None
        att = deal.ledger.running.get((tile, attempt))
        if att is not None:
            self._rts.record(m, deal.work.shape, now - att.sent_at)
        m.last_progress, m.suspect = now, False
        return m

    def _release(self, deal: Deal, tile: int, attempt: int) -> None:
        att = deal.ledger.running.get((tile, attempt))
        nbytes = deal.bytes.pop((tile, attempt), 0)
        deal.leaving.discard((tile, attempt))
        if att is not None and att.worker in self.members:
            self.members[att.worker].inflight_bytes -= nbytes

    def _suspect(self, m: Member, now: float, cause: str, since: float) -> None:
        """`m` is presumed lost: its tiles are given back, and it is tried again after `suspect_retry`."""
        m.suspect, m.suspect_since = True, now
        self._clock.suspect(m, now)
        self._lose(m, now, cause, since)

    def _lose(self, m: Member, now: float, cause: str, silent_since: float) -> None:
        self._notes.append(WorkerLost(m.id, cause))
        self._hungry.pop(m.id, None)
        self._idle.pop(m.id, None)
        for deal in self._ranked:
            for att in deal.ledger.inflight(m.id):
                self._release(deal, att.tile, att.attempt)
            lost = deal.ledger.give_back(m.id, deal.work.chunks)
            if lost:
                rec = Recovery(m.id, cause, silent_since, now, set(lost), len(lost), seq=deal.work.seq)
                deal.recoveries.append(rec)
                self._notes.append(TilesLost(rec))
