"""When each member of the dealer next owes a result, and when each suspect is tried again: two heaps, so
that a tick costs O(log n) per member that is due, not a pass over the fleet.

A member with tiles in flight owes a result `timeout_factor` x its usual time for its oldest tile (its
round trips on that GEMM shape, or the cost model's time on its declared profile, whichever is longer), and
at least `tile_timeout_s`, counted from its last progress or from when that tile left the PS, whichever is
later. A suspect still in the plan is tried again `suspect_retry` tile timeouts after it became one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from cleave.gemm.dealer.model import Deal, Member, Policy
from cleave.gemm.ledger import Attempt


class Deadlines:
    def __init__(self, policy: Policy) -> None:
        self.p = policy
        self._due: list[tuple[float, int, str, int]] = []  # (due, order, member, token)
        self._retry: list[tuple[float, int, str, float]] = []  # (retry at, order, member, suspect since)
        self._order = itertools.count()

    def clear(self) -> None:
        """No GEMM in flight: nobody owes anything."""
        self._due = []

    def next_at(self) -> float:
        return min((heap[0][0] for heap in (self._due, self._retry) if heap), default=math.inf)

    def arm(self, m: Member, ranked: Sequence[Deal]) -> None:
        """`m`'s deadline from now on (an earlier one it had no longer counts: its token moved on)."""
        m.token += 1
        deal, oldest = oldest_of(m, ranked)
        due = max(m.last_progress, oldest.sent_at) + self.allowed_s(m, deal, oldest)
        heapq.heappush(self._due, (due, next(self._order), m.id, m.token))

    def suspect(self, m: Member, now: float) -> None:
        """`m` became a suspect now: it is tried again after `suspect_retry` tile timeouts."""
        heapq.heappush(self._retry, (now + self.p.suspect_retry * self.p.tile_timeout_s, next(self._order), m.id, now))

    def retried(self, now: float, members: Mapping[str, Member]) -> list[str]:
        """Suspects whose retry time came (each is no longer suspect, and not proven until its link is)."""
        out = []
        while self._retry and self._retry[0][0] <= now:
            _, _, wid, since = heapq.heappop(self._retry)
            m = members.get(wid)
            if m is not None and m.suspect and m.suspect_since == since:
                m.suspect, m.proven = False, False  # tiles again once a round trip over its downlink succeeds
                out.append(wid)
        return out

    def late(self, now: float, members: Mapping[str, Member], ranked: Sequence[Deal],
             count: Callable[[str], int]) -> list[tuple[Member, float]]:
        """Members past their deadline now, each with since when it owes a result; those whose deadline moved
        (progress meanwhile) are armed again."""
        out = []
        while self._due and self._due[0][0] <= now:
            _, _, wid, token = heapq.heappop(self._due)
            m = members.get(wid)
            if m is None or m.token != token or m.suspect or not count(wid):
                continue
            deal, oldest = oldest_of(m, ranked)
            since = max(m.last_progress, oldest.sent_at)  # since when it owes a result
            if since + self.allowed_s(m, deal, oldest) > now + 1e-9:
                self.arm(m, ranked)
                continue
            out.append((m, since))
        return out

    def allowed_s(self, m: Member, deal: Deal, oldest: Attempt) -> float:
        """How long `m` may owe a result for its oldest tile (see the module docstring)."""
        work = deal.work
        usual = max(m.round_trips.get(work.shape, 0.0), m.predicted_s(deal.ledger.tiles[oldest.tile], work.k, work.b))
        return max(self.p.tile_timeout_s, self.p.timeout_factor * usual)


def oldest_of(m: Member, ranked: Sequence[Deal]) -> tuple[Deal, Attempt]:
    """The oldest tile `m` has in flight, and its GEMM (each ledger issues in time order)."""
    firsts = [(next(iter(d.ledger.by_worker[m.id].values())), d) for d in ranked if d.ledger.count(m.id)]
    att, deal = min(firsts, key=lambda x: x[0].sent_at)
    return deal, att
