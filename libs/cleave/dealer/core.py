"""The dealing of GEMM tiles to a fleet: one pure object that the PS and the simulator both drive.

It decides everything about a GEMM's dealing: which tile goes to which worker next (its planned pieces
first, then shared tiles with cached inputs first, then, once idle, a tile stolen from the device with the
most left), which input blocks travel with a tile and which the worker already caches (a mirror of its
LRU), how much a worker may have in flight (tiles and bytes), when a worker that makes no progress is
presumed lost and its tiles given back (cut for several devices), when a straggling tile is copied to an
idle worker, and when a suspect worker is tried again. It does no I/O and keeps no clock: every call
takes `now`, and returns the tiles to send (`Send`) for the caller to put on its wire or its simulated
links. Every event costs O(log n) in the number of workers and tiles: deadlines, suspicions and lone
attempts are kept in heaps, the round trips of a GEMM shape in a sorted list (their median), and only
workers that asked for work and found none are offered new work when some appears.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from sortedcontainers import SortedList

from cleave.dealer.model import (
    DEFAULT_INFLIGHT_S,
    JOINS_KEPT,
    LEFT_KEPT,
    RT_WEIGHT,
    TYPICAL_SAMPLE,
    BlockSend,
    Member,
    Policy,
    Recovery,
    Send,
    Shape,
    Work,
)
from cleave.fanout import a_id, b_id
from cleave.ledger import Attempt, GemmLedger
from cleave.schemas import DeviceProfile


class Dealer:
    """Deals one GEMM at a time to a changing set of members (see the module docstring).

    The caller tells it what happens (`set_fleet`, `begin`, `done`, `failed`, `discard`, `heard`, `tick`)
    and sends what each call returns; `next_check_at` says when `tick` next has something to do."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.p = policy or Policy()
        self.members: dict[str, Member] = {}
        self.work: Work | None = None
        self.ledger: GemmLedger | None = None
        self.recoveries: list[Recovery] = []  # of the GEMM in flight, open and closed
        self.closed: list[Recovery] = []  # closed since the caller last took them (`take_closed`)
        self.suspected: list[str] = []  # presumed lost by a deadline since the caller last looked
        self._hungry: dict[str, None] = {}  # live members that asked for work and found none (in order)
        self._idle: dict[str, None] = {}  # ... of which those with nothing in flight
        self._deadlines: list[tuple[float, int, str, int]] = []  # (due, order, member, token)
        self._suspects: list[tuple[float, int, str, float]] = []  # (retry at, order, member, suspect since)
        self._rts: dict[Shape, SortedList] = {}  # each member's round trip on a shape, sorted
        self._bytes: dict[tuple[int, int], int] = {}  # (tile, attempt) -> input bytes it carried
        self._order = itertools.count()
        self._typical = 0.0  # the median predicted tile time of the GEMM in flight
        self.joined: dict[str, set[str]] = {}  # worker -> the fan-out groups it has subscribed to
        self._refused: dict[int, set[str]] = {}  # tile -> workers that refused it in the GEMM in flight
        self._joins: dict[str, deque[set[str]]] = {}  # worker -> the groups of its latest joins
        self._published: dict[str, str] = {}  # blocks of the GEMM in flight published -> their group
        self._inline: set[tuple[str, str]] = set()  # (worker, block) it said it lacked: sent with its tiles
        self._left: OrderedDict[str, None] = OrderedDict()  # workers that left (the latest LEFT_KEPT)
        self.checks: list[str] = []  # returning members whose link must be proven (`take_checks`, `proved`)

    # ---- the fleet ---------------------------------------------------------------------------------
    def set_fleet(self, fleet: Iterable[tuple[str, int, DeviceProfile | None]], now: float,
                  cause: str = "heartbeat_timeout") -> list[Send]:
        """The members are now exactly `fleet` (id, cache bytes, profile): newcomers join, the others are
        lost (their tiles given back). Returns what to send."""
        fleet = list(fleet)
        for wid, cache, profile in fleet:
            m = self.members.get(wid)
            if m is None:
                back = self._left.pop(wid, 0) is None  # it was here before, and left
                self.members[wid] = Member(wid, cache, profile, last_progress=now, proven=not back)
                if back:
                    self.checks.append(wid)
            else:
                m.cache_bytes, m.profile = cache, profile
        keep = {wid for wid, _, _ in fleet}
        for gone in [w for w in self.members if w not in keep]:
            self.remove(gone, now, cause)
        return self._offer(now, self.members)

    def join(self, worker: str, groups: Iterable[str]) -> None:
        """`worker` has subscribed to `groups`, and keeps those of its previous join (`JOINS_KEPT`: a GEMM in
        flight when a plan changes goes on with the groups it began with); it left any older ones."""
        joins = self._joins.setdefault(worker, deque(maxlen=JOINS_KEPT))
        joins.append(set(groups))
        self.joined[worker] = set().union(*joins)

    def remove(self, worker: str, now: float, cause: str) -> None:
        """`worker` is gone for good (left the plan, or caught lying): its tiles are given back."""
        m = self.members.get(worker)
        if m is None:
            return
        self._lose(m, now, cause, m.last_progress)
        self._forget_rts(m)
        self.joined.pop(worker, None)
        self._joins.pop(worker, None)
        del self.members[worker]
        self._left[worker] = None
        while len(self._left) > LEFT_KEPT:
            self._left.popitem(last=False)

    def take_checks(self) -> list[str]:
        """Members that came back since the caller last asked: each gets tiles only once `proved`."""
        checks, self.checks = self.checks, []
        return checks

    def proved(self, worker: str, now: float) -> list[Send]:
        """A round trip over `worker`'s downlink succeeded: it is dealt tiles again. Returns what to send."""
        m = self.members.get(worker)
        if m is None or m.proven:
            return []
        m.proven, m.last_progress = True, now
        return self._offer(now, [worker])

    # ---- one GEMM ----------------------------------------------------------------------------------
    def begin(self, work: Work, now: float) -> list[Send]:
        """Start dealing `work`: every live member gets a tile before any gets a second."""
        owners = [o if o in self.members else None for o in work.owners] if work.owners else None
        self.work, self.ledger = work, GemmLedger(work.tiles, owners)
        self.recoveries, self.closed, self._bytes, self._published, self._refused = [], [], {}, {}, {}
        self._inline = set()
        self._deadlines, self._hungry, self._idle = [], {}, {}
        for m in self.members.values():
            m.inflight_bytes = 0
        self._typical = self._median_predicted(work, owners)
        out: list[Send] = []
        for depth in range(1, max(self.p.window, work.chunks) + 1):
            for m in list(self.members.values()):
                out += self._fill(m, now, depth)
        return out

    def end(self) -> None:
        """The GEMM is over (done, or abandoned): nothing of it is dealt any more."""
        self.work = self.ledger = None
        self._hungry, self._idle, self._deadlines, self._bytes = {}, {}, [], {}

    @property
    def complete(self) -> bool:
        return self.ledger is not None and self.ledger.complete

    def extra(self, tile: int, worker: str, now: float) -> Send:
        """One more attempt of `tile` on `worker` whose result is not assembled (a verification copy)."""
        m = self.members[worker]
        return self._send(m, self.ledger.issue_extra(tile, worker, now), now)

    # ---- results -----------------------------------------------------------------------------------
    def done(self, worker: str, tile: int, attempt: int, now: float) -> tuple[str, list[Send]]:
        """A valid block for (tile, attempt) from `worker`: "accepted" (the first), "duplicate" or
        "unknown"; returns the outcome and what to send next."""
        led = self.ledger
        m = self._progress(worker, tile, attempt, now)
        twins = [led.running[(tile, a)].worker for a in led.by_tile.get(tile, ()) if a != attempt]
        for a in list(led.by_tile.get(tile, ())):
            self._release(tile, a)
        outcome = led.finish(tile, attempt)
        if outcome == "accepted":
            self._close(tile, now)
            out = self._beaten(twins, now)
            if m is not None:
                m.beaten = 0
        else:
            out = []
        if led.complete:
            return outcome, []
        out += self._fill(m, now) if m is not None else []
        for other in twins:  # a speculative twin was dropped: its worker has room again
            if other in self.members:
                out += self._fill(self.members[other], now)
        return outcome, out

    def _beaten(self, twins: list[str], now: float) -> list[Send]:
        """Another attempt finished first: a worker beaten `beaten_limit` times in a row is suspect, as one
        that missed a deadline (its tiles given back, tried again later)."""
        out: list[Send] = []
        for wid in twins:
            m = self.members.get(wid)
            if m is None or m.suspect:
                continue
            m.beaten += 1
            if self.p.beaten_limit and m.beaten >= self.p.beaten_limit:
                m.beaten = 0
                self._suspect(m, now, "duplicates", m.last_progress)
                out += self._offer(now, list(self._hungry))
        return out

    def failed(self, worker: str, tile: int, attempt: int, now: float, missing: Sequence[str] = ()) -> list[Send]:
        """(tile, attempt) will not produce a block: the worker lacked cached `missing` blocks (it gets the
        tile again, with them), or it refused the tile (it goes to another worker, unless every live member
        has refused it: then they all try again). The tile goes to the front of the queue."""
        m = self._progress(worker, tile, attempt, now)
        if m is not None:
            for block_id in missing:
                m.forget(block_id)
                self._inline.add((worker, block_id))  # not from its group again: it may have missed it
        self._release(tile, attempt)
        self.ledger.retry(tile, attempt)
        if missing:
            return self._offer(now, [worker])
        refused = self._refused.setdefault(tile, set())
        refused.add(worker)
        if all(w in refused for w, m in self.members.items() if not m.suspect):
            refused.clear()  # nobody else can: do not leave the tile undealt
        return self._offer(now, [*self._hungry, worker])

    def discard(self, worker: str, tile: int, attempt: int, now: float) -> list[Send]:
        """(tile, attempt) answered, but its block is not assembled here (a verification copy)."""
        m = self._progress(worker, tile, attempt, now)
        self._release(tile, attempt)
        self.ledger.drop(tile, attempt)
        return self._fill(m, now) if m is not None else []

    def departed(self, tile: int, attempt: int, at: float) -> None:
        """A send left the PS only at `at` (behind others on the PS's link): the worker owes its result, and
        the tile's age for a copy counts, from then."""
        if self.ledger is not None:
            self.ledger.departed(tile, attempt, at)

    def redo(self, worker: str, now: float) -> list[Send]:
        """What `worker` has in flight will not be heard of (its results were dropped unread): deal it again."""
        if self.ledger is None:
            return []
        for att in self.ledger.inflight(worker):
            self._release(att.tile, att.attempt)
            self.ledger.retry(att.tile, att.attempt)
        return self._offer(now, [*self._hungry, worker])

    def heard(self, worker: str) -> None:
        """`worker` answered for a GEMM that is over: it is alive."""
        if worker in self.members:
            self.members[worker].suspect = False

    def running(self, worker: str, tile: int, attempt: int) -> Attempt | None:
        return self.ledger.running.get((tile, attempt)) if self.ledger is not None else None

    def take_closed(self) -> list[Recovery]:
        closed, self.closed = self.closed, []
        return closed

    # ---- time --------------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Send]:
        """Suspects whose retry time came are tried again, workers past their deadline are presumed lost,
        their tiles dealt to whoever has room, and idle workers copy tiles that run far too long."""
        if self.ledger is None:
            return []
        out: list[Send] = []
        while self._suspects and self._suspects[0][0] <= now:
            _, _, wid, since = heapq.heappop(self._suspects)
            m = self.members.get(wid)
            if m is not None and m.suspect and m.suspect_since == since:
                m.suspect = False
                out += self._fill(m, now)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, wid, token = heapq.heappop(self._deadlines)
            m = self.members.get(wid)
            if m is None or m.token != token or m.suspect or not self.ledger.count(wid):
                continue
            since = self._since(m)
            if since + self._deadline_s(m) > now + 1e-9:
                self._arm(m)
                continue
            self._suspect(m, now, "tile_deadline", since)
        out += self._offer(now, list(self._hungry) if self.ledger.queued else ())
        return out + self._speculate_idle(now)

    def next_check_at(self, now: float) -> float:
        """When `tick` next may change something (deadlines exactly; copies at most once per `tick_s`)."""
        at = math.inf
        for heap in (self._deadlines, self._suspects):
            if heap:
                at = min(at, heap[0][0])
        if self.ledger is not None and self.p.speculate_factor > 0 and self._idle:
            oldest = self.ledger.oldest_lone()
            if oldest is not None:
                at = min(at, max(oldest.sent_at + self._threshold(), now + self.p.tick_s))
        return at

    # ---- dealing -----------------------------------------------------------------------------------
    def _fill(self, m: Member, now: float, depth: int | None = None) -> list[Send]:
        """Give `m` tiles up to its room (and `depth`): planned, shared, stolen, or a copy once idle."""
        led, w, out = self.ledger, m.id, []
        if led is None or m.suspect or not m.proven or w not in self.members:
            return out
        hungry = False
        while led.count(w) < min(depth or math.inf, led.room(w, self.p.window, self.work.chunks)):
            if led.count(w) and self._over_budget(m):
                break
            att = led.take(w, now, self._score(m), self._avoid(w)) if led.dealable() else None
            if att is None and not led.count(w):
                att = self._speculate(m, now)
            if att is None:
                hungry = True
                break
            if led.count(w) == 1:
                m.last_progress = now  # the clock of an idle worker starts now
            out.append(self._send(m, att, now))
        self._mark(m, hungry)
        if out or led.count(w):
            self._arm(m)
        return out

    def _avoid(self, worker: str) -> set[int]:
        """The tiles `worker` refused in this GEMM."""
        return {t for t, who in self._refused.items() if worker in who} if self._refused else set()

    def _mark(self, m: Member, hungry: bool) -> None:
        for group, member in ((self._hungry, hungry), (self._idle, hungry and not self.ledger.count(m.id))):
            if member:
                group[m.id] = None
            else:
                group.pop(m.id, None)

    def _offer(self, now: float, ids: Iterable[str]) -> list[Send]:
        """Work appeared in the shared queue: members in `ids` take what they have room for."""
        out: list[Send] = []
        if self.ledger is None:
            return out
        for wid in ids:
            m = self.members.get(wid)
            if m is not None:
                out += self._fill(m, now)
        return out

    def _speculate_idle(self, now: float) -> list[Send]:
        led, out = self.ledger, []
        if self.p.speculate_factor <= 0 or not self._idle:
            return out
        oldest = led.oldest_lone()
        if oldest is None or now - oldest.sent_at <= self._threshold():
            return out
        for wid in list(self._idle):
            before = led.speculated
            out += self._fill(self.members[wid], now)
            if led.speculated == before:
                break  # nothing is old enough for anyone
        return out

    def _speculate(self, m: Member, now: float) -> Attempt | None:
        if self.p.speculate_factor <= 0:
            return None
        return self.ledger.speculate(m.id, now, self._threshold())

    def _threshold(self) -> float:
        return max(self.p.speculate_min_s, self.p.speculate_factor * self._usual())

    def _usual(self) -> float:
        """The median round trip of this GEMM's shape over the members, or the median predicted tile time
        before any (or `tile_timeout_s` when no profile predicts one)."""
        trips = self._rts.get(self.work.shape)
        if trips:
            return trips[len(trips) // 2]
        return self._typical or self.p.tile_timeout_s

    def _over_budget(self, m: Member) -> bool:
        """Whether one more tile would put more bytes in flight to `m` than it may hold: the policy's limit,
        or two seconds of its downlink when that is less."""
        cap = self.p.max_inflight_bytes
        if cap is None:
            return False
        if m.profile is not None:
            cap = min(cap, int(DEFAULT_INFLIGHT_S * m.profile.downlink_bytes_per_s))
        return m.inflight_bytes >= cap

    def _score(self, m: Member):  # noqa: ANN202
        if not m.known:
            return None
        work, known = self.work, m.known
        if work.parts:
            return lambda t: self._known(known, a_id(work.a_key, t), t.rows) + self._known(known, b_id(work.b_key, t), t.cols)
        return lambda t: (a_id(work.a_key, t) in known) * t.rows + (b_id(work.b_key, t) in known) * t.cols

    def _known(self, known, block_id: str, rows: int) -> int:  # noqa: ANN001
        """Rows of a block (or of its segments) that a member caches."""
        segs = self.work.parts.get(block_id)
        if not segs:
            return rows * (block_id in known)
        return sum(hi - lo for sid, lo, hi in segs if sid in known)

    def _send(self, m: Member, att: Attempt, now: float) -> Send:
        work, t = self.work, self.ledger.tiles[att.tile]
        a = self._input(m, a_id(work.a_key, t), t.r0, t.r1)
        b = self._input(m, b_id(work.b_key, t), t.c0, t.c1)
        nbytes = (a.rows("data") + b.rows("data")) * work.k * work.b
        pushed = (a.rows("publish") + b.rows("publish")) * work.k * work.b
        m.inflight_bytes += nbytes + pushed
        self._bytes[(att.tile, att.attempt)] = nbytes + pushed
        for rec in self.recoveries:
            if att.tile in rec.tiles:
                rec.redispatched_at = now
        return Send(m.id, t, att.attempt, a, b, nbytes, pushed)

    def _input(self, m: Member, block_id: str, lo: int, hi: int) -> BlockSend:
        """How an input block of a tile reaches `m`: whole, or as its segments (`Work.parts`)."""
        row = self.work.k * self.work.b
        segs = self.work.parts.get(block_id) if self.work.parts else None
        if not segs:
            return self._block(m, block_id, lo, hi, (hi - lo) * row)
        return BlockSend(block_id, lo, hi, False, parts=tuple(self._block(m, sid, slo, shi, (shi - slo) * row)
                                                              for sid, slo, shi in segs))

    def _block(self, m: Member, block_id: str, lo: int, hi: int, nbytes: int) -> BlockSend:
        """How a block reaches `m`: it caches it already, or it comes from its fan-out group (published now
        if it is the first of the group to need it), or it travels with the tile."""
        if block_id in m.known:  # (a published one may still be on its way: the worker waits for it)
            m.known.move_to_end(block_id)
            return BlockSend(block_id, lo, hi, False, self._published.get(block_id, ""))
        group = self.work.shared.get(block_id) if self.work.shared else None
        if (group is not None and group[0] in self.joined.get(m.id, ()) and nbytes <= m.cache_bytes
                and (m.id, block_id) not in self._inline):
            name, members = group
            first = block_id not in self._published
            if first:  # every subscribed member receives it, and caches it
                self._published[block_id] = name
                for wid in members:
                    if wid in self.members and name in self.joined.get(wid, ()):
                        self.members[wid].remember(block_id, nbytes)
            return BlockSend(block_id, lo, hi, False, name, first)
        m.remember(block_id, nbytes)
        return BlockSend(block_id, lo, hi, True)

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _progress(self, worker: str, tile: int, attempt: int, now: float) -> Member | None:
        """`worker` answered (tile, attempt): its round trip, progress clock and suspicion."""
        m = self.members.get(worker)
        if m is None:
            return None
        att = self.ledger.running.get((tile, attempt))
        if att is not None:
            rt, shape = now - att.sent_at, self.work.shape
            old = m.round_trips.get(shape, 0.0)
            new = rt if old == 0 else (1 - RT_WEIGHT) * old + RT_WEIGHT * rt
            trips = self._rts.setdefault(shape, SortedList())
            if old:
                trips.remove(old)
            trips.add(new)
            m.round_trips[shape] = new
        m.last_progress, m.suspect = now, False
        return m

    def _forget_rts(self, m: Member) -> None:
        for shape, rt in m.round_trips.items():
            self._rts[shape].remove(rt)

    def _release(self, tile: int, attempt: int) -> None:
        att = self.ledger.running.get((tile, attempt))
        nbytes = self._bytes.pop((tile, attempt), 0)
        if att is not None and att.worker in self.members:
            self.members[att.worker].inflight_bytes -= nbytes

    def _close(self, tile: int, now: float) -> None:
        for rec in self.recoveries:
            if rec.done_at is None and tile in rec.tiles:
                rec.tiles.discard(tile)
                if not rec.tiles:
                    rec.done_at = now
                    self.closed.append(rec)

    def _suspect(self, m: Member, now: float, cause: str, since: float) -> None:
        """`m` is presumed lost: its tiles are given back, and it is tried again after `suspect_retry`."""
        m.suspect, m.suspect_since = True, now
        self.suspected.append(m.id)
        heapq.heappush(self._suspects, (now + self.p.suspect_retry * self.p.tile_timeout_s,
                                        next(self._order), m.id, now))
        self._lose(m, now, cause, since)

    def _lose(self, m: Member, now: float, cause: str, silent_since: float) -> None:
        self._hungry.pop(m.id, None)
        self._idle.pop(m.id, None)
        if self.ledger is None:
            return
        for att in self.ledger.inflight(m.id):
            self._release(att.tile, att.attempt)
        lost = self.ledger.give_back(m.id, self.work.chunks)
        if lost:
            self.recoveries.append(Recovery(m.id, cause, silent_since, now, set(lost), len(lost)))

    def _since(self, m: Member) -> float:
        """Since when `m` owes a result: its last progress, or its oldest tile in flight if later."""
        oldest = next(iter(self.ledger.by_worker[m.id].values()))  # issued in time order
        return max(m.last_progress, oldest.sent_at)

    def _deadline_s(self, m: Member) -> float:
        """How long `m` may owe a result: `timeout_factor` x its usual time for its oldest tile (its round
        trips on this shape, or the cost model's time on its profile, whichever is longer), at least
        `tile_timeout_s`."""
        work = self.work
        oldest = next(iter(self.ledger.by_worker[m.id].values()))
        usual = max(m.round_trips.get(work.shape, 0.0), m.predicted_s(self.ledger.tiles[oldest.tile], work.k, work.b))
        return max(self.p.tile_timeout_s, self.p.timeout_factor * usual)

    def _arm(self, m: Member) -> None:
        m.token += 1
        due = self._since(m) + self._deadline_s(m)
        heapq.heappush(self._deadlines, (due, next(self._order), m.id, m.token))

    def _median_predicted(self, work: Work, owners: Sequence[str | None] | None) -> float:
        """The median predicted tile time: each planned tile on its owner, else on a middle member."""
        members = [m for m in self.members.values() if m.profile is not None]
        if not members or not work.tiles:
            return 0.0
        middle = members[len(members) // 2]
        step = max(1, len(work.tiles) // TYPICAL_SAMPLE)
        times = sorted(
            (self.members[o] if o is not None and self.members[o].profile is not None else middle)
            .predicted_s(work.tiles[i], work.k, work.b)
            for i, o in ((i, owners[i] if owners else None) for i in range(0, len(work.tiles), step))
        )
        return times[len(times) // 2]
