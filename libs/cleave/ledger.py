"""The tile ledger of one GEMM (pure, no I/O): which tiles are pending, running where, and done.

A tile is done exactly once: the first valid result wins and later ones are counted as duplicates.
A worker that stops making progress has its running tiles put back at the front of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cleave.tiles import Tile

Outcome = Literal["accepted", "duplicate", "unknown"]
DEFAULT_AFFINITY_SCAN = 32  # pending tiles looked at when choosing one whose inputs a worker caches


@dataclass
class Attempt:
    tile: int
    attempt: int
    worker: str
    sent_at: float


@dataclass
class GemmLedger:
    tiles: list[Tile]
    owners: list[str | None] | None = None  # the planned device of each tile; None = anyone's
    pending: deque[int] = field(init=False)  # tiles without an owner, or given back
    owned: dict[str, deque[int]] = field(init=False)  # planned tiles not yet handed out, per device
    owned_by: set[str] = field(init=False)
    running: dict[tuple[int, int], Attempt] = field(default_factory=dict)  # (tile, attempt) -> attempt
    done: set[int] = field(default_factory=set)
    issued: list[int] = field(init=False)  # attempts handed out per tile
    resent: int = 0
    duplicates: int = 0
    speculated: int = 0

    def __post_init__(self) -> None:
        self.pending, self.owned = deque(), {}
        for t in self.tiles:
            owner = self.owners[t.index] if self.owners else None
            (self.owned.setdefault(owner, deque()) if owner else self.pending).append(t.index)
        self.issued = [0] * len(self.tiles)
        self.owned_by = set(self.owned)  # devices the plan gave work: only they steal (others would be slow)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.tiles)

    def inflight(self, worker: str) -> list[Attempt]:
        return [a for a in self.running.values() if a.worker == worker]

    def _issue(self, tile: int, worker: str, now: float) -> Attempt:
        att = Attempt(tile, self.issued[tile], worker, now)
        self.issued[tile] += 1
        self.running[(tile, att.attempt)] = att
        return att

    def take(self, worker: str, now: float, score: Callable[[Tile], int] | None = None) -> Attempt | None:
        """The next tile for `worker`: its own planned ones, then shared ones (cached inputs first), then
        one stolen from the device with the most left, so that fast devices take more."""
        own = self.owned.get(worker)
        while own:
            tile = own.popleft()
            if tile not in self.done:
                return self._issue(tile, worker, now)
        tile = self._shared(score)
        if tile is None and (not self.owners or worker in self.owned_by):  # a device the plan left out is slow
            victim = max(self.owned.values(), key=len, default=None)
            while victim:
                tile = victim.pop()
                if tile not in self.done:
                    break
                tile = None
        return None if tile is None else self._issue(tile, worker, now)

    def _shared(self, score: Callable[[Tile], int] | None) -> int | None:
        while self.pending and self.pending[0] in self.done:
            self.pending.popleft()
        if not self.pending:
            return None
        pos = 0
        if score is not None:
            best = -1
            for i, t in enumerate(list(self.pending)[:DEFAULT_AFFINITY_SCAN]):
                s = score(self.tiles[t]) if t not in self.done else -1
                if s > best:
                    best, pos = s, i
        tile = self.pending[pos]
        del self.pending[pos]
        return tile

    def speculate(self, worker: str, now: float, min_age_s: float) -> Attempt | None:
        """A second copy, for an idle `worker`, of the oldest tile running elsewhere for over `min_age_s`."""
        counts: dict[int, int] = {}
        for a in self.running.values():
            counts[a.tile] = counts.get(a.tile, 0) + 1
        old = [a for a in self.running.values()
               if a.worker != worker and counts[a.tile] == 1 and now - a.sent_at > min_age_s]
        if not old:
            return None
        self.speculated += 1
        return self._issue(min(old, key=lambda a: a.sent_at).tile, worker, now)

    def issue_extra(self, tile: int, worker: str, now: float) -> Attempt:
        """One more attempt of a tile for `worker` (a verification copy); its result is not assembled."""
        return self._issue(tile, worker, now)

    def was_issued(self, tile: int, attempt: int) -> bool:
        return 0 <= tile < len(self.tiles) and 0 <= attempt < self.issued[tile]

    def finish(self, tile: int, attempt: int) -> Outcome:
        """Record a valid result; only the first for a tile is accepted."""
        if not self.was_issued(tile, attempt):
            return "unknown"
        self.running.pop((tile, attempt), None)
        if tile in self.done:
            self.duplicates += 1
            return "duplicate"
        self.done.add(tile)
        for key in [k for k in self.running if k[0] == tile]:  # a speculative twin is no longer needed
            del self.running[key]
        return "accepted"

    def retry(self, tile: int, attempt: int) -> None:
        """This attempt will not produce a block (cache miss, refusal): send the tile again, first."""
        if self.running.pop((tile, attempt), None) is not None and tile not in self.done:
            self.pending.appendleft(tile)

    def give_back(self, worker: str) -> list[int]:
        """The worker is presumed gone: its running and planned tiles go back to the shared queue."""
        lost = [a for a in self.running.values() if a.worker == worker]
        for a in lost:
            del self.running[(a.tile, a.attempt)]
        running_elsewhere = {a.tile for a in self.running.values()}
        tiles = sorted({a.tile for a in lost} - self.done - running_elsewhere)
        self.pending.extendleft(reversed(tiles))
        self.pending.extend(self.owned.pop(worker, ()))
        self.resent += len(tiles)
        return tiles
