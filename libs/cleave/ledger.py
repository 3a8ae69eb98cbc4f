"""The tile ledger of one GEMM (pure, no I/O): which tiles are pending, running where, and done.

A tile is done exactly once: the first valid result wins and later ones are counted as duplicates.
A worker that stops making progress has its running tiles put back at the front of the queue, cut into
smaller tiles when asked (`give_back(worker, split)`): a lost block is then redone by several devices at once
instead of one. A tile cut that way is retired: its own late result is counted as a duplicate.
Running attempts are indexed by worker and by tile, so that a result, a loss or a worker's count of tiles
in flight costs the same for 10,000 devices as for 10.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cleave.tiles import Tile, cut_block

Outcome = Literal["accepted", "duplicate", "unknown"]
DEFAULT_WINDOW = 2  # tiles in flight per worker (one computing, one arriving); a planned block's pieces stream
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
    by_worker: dict[str, dict[tuple[int, int], Attempt]] = field(default_factory=dict)  # index of running
    by_tile: dict[int, set[int]] = field(default_factory=dict)  # tile -> its running attempts
    done: set[int] = field(default_factory=set)
    issued: list[int] = field(init=False)  # attempts handed out per tile
    unissued: int = field(init=False)  # tiles (not retired) never handed out
    retired: set[int] = field(default_factory=set)  # tiles given back and replaced by smaller ones
    parent: dict[int, int] = field(default_factory=dict)  # a tile cut from a retired one -> that one
    kids: dict[int, list[int]] = field(default_factory=dict)  # a retired tile -> the tiles cut from it
    resent: int = 0
    duplicates: int = 0
    speculated: int = 0

    def __post_init__(self) -> None:
        self.tiles = list(self.tiles)  # tiles cut from retired ones are appended: never the caller's list
        self.pending, self.owned = deque(), {}
        for t in self.tiles:
            owner = self.owners[t.index] if self.owners else None
            (self.owned.setdefault(owner, deque()) if owner else self.pending).append(t.index)
        self.issued = [0] * len(self.tiles)
        self.unissued = len(self.tiles)
        self.owned_by = set(self.owned)  # devices the plan gave work: only they steal (others would be slow)

    @property
    def complete(self) -> bool:
        return len(self.done) + len(self.retired) == len(self.tiles)

    def covered(self, tile: int) -> bool:
        """Whether `tile`'s output is done: by its own result, or by those of the tiles cut from it."""
        return tile in self.done or (tile in self.retired and all(self.covered(k) for k in self.kids[tile]))

    def dealable(self) -> bool:
        """Whether `take` may find a tile: some were never handed out, or some were given back."""
        return self.unissued > 0 or any(t not in self.done for t in self.pending)

    def inflight(self, worker: str) -> list[Attempt]:
        return list(self.by_worker.get(worker, {}).values())

    def count(self, worker: str) -> int:
        """Attempts running on `worker`."""
        return len(self.by_worker.get(worker, ()))

    def owns(self, worker: str) -> bool:
        """Whether the plan still has tiles for `worker` that it has not been handed."""
        own = self.owned.get(worker)
        while own and own[0] in self.done:
            own.popleft()
        return bool(own)

    def room(self, worker: str, window: int, chunks: int) -> int:
        """Tiles `worker` may have in flight: the pieces of its planned blocks stream (up to `chunks` at
        once); anything else is dealt `window` at a time."""
        return max(window, chunks) if self.owns(worker) else window

    def _issue(self, tile: int, worker: str, now: float) -> Attempt:
        att = Attempt(tile, self.issued[tile], worker, now)
        self.unissued -= self.issued[tile] == 0
        self.issued[tile] += 1
        key = (tile, att.attempt)
        self.running[key] = att
        self.by_worker.setdefault(worker, {})[key] = att
        self.by_tile.setdefault(tile, set()).add(att.attempt)
        return att

    def drop(self, tile: int, attempt: int) -> Attempt | None:
        """Forget a running attempt (its result came, or will not come); returns it if it was running."""
        att = self.running.pop((tile, attempt), None)
        if att is not None:
            mine = self.by_worker[att.worker]
            del mine[(tile, attempt)]
            if not mine:
                del self.by_worker[att.worker]
            twins = self.by_tile[tile]
            twins.discard(attempt)
            if not twins:
                del self.by_tile[tile]
        return att

    def take(self, worker: str, now: float, score: Callable[[Tile], int] | None = None) -> Attempt | None:
        """The next tile for `worker`: its own planned ones, then shared ones (cached inputs first), then,
        if it has nothing in flight, one stolen from the device with the most left, so that fast devices take
        more (a busy worker would only queue the stolen tile behind its own work)."""
        own = self.owned.get(worker)
        while own:
            tile = own.popleft()
            if tile not in self.done:
                return self._issue(tile, worker, now)
        tile = self._shared(score)
        # a device the plan left out is slow for this GEMM: it does not steal
        if tile is None and not self.count(worker) and (not self.owners or worker in self.owned_by):
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
        for a in self.running.values():  # in the order they were issued: the oldest first
            if now - a.sent_at <= min_age_s:
                return None
            if a.worker != worker and len(self.by_tile[a.tile]) == 1:
                self.speculated += 1
                return self._issue(a.tile, worker, now)
        return None

    def issue_extra(self, tile: int, worker: str, now: float) -> Attempt:
        """One more attempt of a tile for `worker` (a verification copy); its result is not assembled."""
        return self._issue(tile, worker, now)

    def was_issued(self, tile: int, attempt: int) -> bool:
        return 0 <= tile < len(self.tiles) and 0 <= attempt < self.issued[tile]

    def finish(self, tile: int, attempt: int) -> Outcome:
        """Record a valid result; only the first for a tile is accepted."""
        if not self.was_issued(tile, attempt):
            return "unknown"
        self.drop(tile, attempt)
        if tile in self.done or tile in self.retired:
            self.duplicates += 1
            return "duplicate"
        self.done.add(tile)
        for twin in list(self.by_tile.get(tile, ())):  # a speculative twin is no longer needed
            self.drop(tile, twin)
        return "accepted"

    def retry(self, tile: int, attempt: int) -> None:
        """This attempt will not produce a block (cache miss, refusal): send the tile again, first."""
        if self.drop(tile, attempt) is not None and tile not in self.done:
            self.pending.appendleft(tile)

    def give_back(self, worker: str, split: int = 1) -> list[int]:
        """The worker is presumed gone: its running tiles go back to the front of the shared queue, its
        planned ones to the back, each cut into at least `split` tiles where it is large enough
        (`tiles.cut_block`). Returns the running tiles' replacements (those to be sent again)."""
        lost = self.inflight(worker)
        for a in lost:
            self.drop(a.tile, a.attempt)
        tiles = sorted({a.tile for a in lost if a.tile not in self.done and a.tile not in self.by_tile})
        tiles = [k for t in tiles for k in self._cut(t, split)]
        self.pending.extendleft(reversed(tiles))
        self.pending.extend(k for t in self.owned.pop(worker, ()) if t not in self.done for k in self._cut(t, split))
        self.resent += len(tiles)
        return tiles

    def _cut(self, tile: int, parts: int) -> list[int]:
        """`tile` itself, or the tiles it is cut into (it is retired)."""
        t = self.tiles[tile]
        boxes = cut_block((t.r0, t.r1, t.c0, t.c1), t.rows, t.cols, parts) if parts > 1 else []
        if len(boxes) < 2:
            return [tile]
        self.retired.add(tile)
        self.unissued -= self.issued[tile] == 0
        self.kids[tile] = []
        for box in boxes:
            kid = len(self.tiles)
            self.tiles.append(Tile(kid, *box))
            self.issued.append(0)
            self.unissued += 1
            self.parent[kid] = tile
            self.kids[tile].append(kid)
        return self.kids[tile]
