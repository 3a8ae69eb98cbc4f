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
    pending: deque[int] = field(init=False)
    running: dict[tuple[int, int], Attempt] = field(default_factory=dict)  # (tile, attempt) -> attempt
    done: set[int] = field(default_factory=set)
    issued: list[int] = field(init=False)  # attempts handed out per tile
    resent: int = 0
    duplicates: int = 0

    def __post_init__(self) -> None:
        self.pending = deque(t.index for t in self.tiles)
        self.issued = [0] * len(self.tiles)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.tiles)

    def inflight(self, worker: str) -> list[Attempt]:
        return [a for a in self.running.values() if a.worker == worker]

    def take(self, worker: str, now: float, score: Callable[[Tile], int] | None = None) -> Attempt | None:
        """Hand the next pending tile to `worker`, preferring one `score` rates highest (cached inputs)."""
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
        att = Attempt(tile, self.issued[tile], worker, now)
        self.issued[tile] += 1
        self.running[(tile, att.attempt)] = att
        return att

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
        """The worker is presumed gone: its running tiles go back to the front of the queue."""
        lost = [a for a in self.running.values() if a.worker == worker]
        for a in lost:
            del self.running[(a.tile, a.attempt)]
        tiles = sorted({a.tile for a in lost} - self.done - self._elsewhere())
        self.pending.extendleft(reversed(tiles))
        self.resent += len(tiles)
        return tiles

    def _elsewhere(self) -> set[int]:
        return {a.tile for a in self.running.values()}

    def speculate(self, tile: int) -> None:
        """Queue a second copy of a running tile for another worker (first result wins)."""
        if tile not in self.done and tile not in self.pending:
            self.pending.append(tile)
            self.resent += 1
