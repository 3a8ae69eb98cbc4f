"""When a late tile is copied to an idle worker (pure, part of the dealing core `cleave.gemm.dealer.core`).

A tile running alone for longer than `max(speculate_min_s, speculate_factor x the median round trip of its
GEMM's shape)` is copied to an idle worker; the first result wins. Two rules keep copies off a PS link that
is already the bottleneck, where tiles queued behind it look late and copying them over the same link slows
it further: no copy while sends already dealt are still to leave the PS (`Copies.departed`), and a GEMM's
copies stop once their bytes exceed `copy_share` of the bytes its other tiles carried (`Deal.may_copy`).
"""

from __future__ import annotations

from collections.abc import Sequence

from cleave.gemm.dealer import trips
from cleave.gemm.dealer.model import Deal, Policy
from cleave.gemm.ledger import Attempt


class Copies:
    """The copy policy over the GEMMs in flight: what is late enough, and whether the PS's link has room."""

    def __init__(self, policy: Policy, rts: trips.RoundTrips) -> None:
        self.p, self._rts = policy, rts
        self.backlog_until = 0.0  # the latest time a send left (or will leave) the PS (`departed`)

    @property
    def on(self) -> bool:
        return self.p.speculate_factor > 0

    def departed(self, deal: Deal | None, tile: int, attempt: int, at: float) -> None:
        """(tile, attempt) left the PS at `at` (the simulator says when it will)."""
        self.backlog_until = max(self.backlog_until, at)
        if deal is not None:
            deal.leaving.discard((tile, attempt))

    def blocked(self, deals: Sequence[Deal], now: float) -> bool:
        """Whether sends dealt are still to leave the PS at `now` (not reported yet, or reported to leave later)."""
        return now < self.backlog_until or any(d.leaving for d in deals)

    def stale(self, deals: Sequence[Deal], now: float) -> bool:
        """Whether a GEMM has a tile late enough to copy, and room for a copy."""
        return any(self._stale(d, now) for d in deals)

    def _stale(self, deal: Deal, now: float) -> bool:
        oldest = deal.ledger.oldest_lone()
        return oldest is not None and now - oldest.sent_at > self.threshold(deal) and deal.may_copy(self.p.copy_share)

    def take(self, deals: Sequence[Deal], worker: str, now: float) -> tuple[Deal | None, Attempt | None]:
        """A copy for idle `worker` of the oldest late tile of the first GEMM, in dealing order, that has one."""
        if self.on and not self.blocked(deals, now):
            for deal in deals:
                if not deal.ledger.complete and deal.may_copy(self.p.copy_share):
                    att = deal.ledger.copy_late(worker, now, self.threshold(deal))
                    if att is not None:
                        return deal, att
        return None, None

    def due(self, deals: Sequence[Deal], now: float) -> float:
        """When a copy may next be made (for the caller's `next_check_at`; at most once per `tick_s`)."""
        at = float("inf")
        if self.on and not any(d.leaving for d in deals):  # (else: once the PS says they left)
            for deal in deals:
                oldest = deal.ledger.oldest_lone()
                if oldest is not None and deal.may_copy(self.p.copy_share):  # (else: not before its next send)
                    at = min(at, max(oldest.sent_at + self.threshold(deal), now + self.p.tick_s, self.backlog_until))
        return at

    def threshold(self, deal: Deal) -> float:
        return max(self.p.speculate_min_s, self.p.speculate_factor * self._usual(deal))

    def _usual(self, deal: Deal) -> float:
        """The median round trip of this GEMM's shape over the members, or the median predicted tile time
        before any (or `tile_timeout_s` when no profile predicts one)."""
        median = self._rts.median(deal.work.shape)
        if median is not None:
            return median
        return deal.typical or self.p.tile_timeout_s
