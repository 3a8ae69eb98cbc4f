"""The tile ledger of one GEMM (pure, no I/O): which tiles are pending, running where, and done.

A tile is done exactly once: the first valid result wins and later ones are counted as duplicates.
A worker that stops making progress has its running tiles put back at the front of the queue, cut into
smaller tiles when asked (`give_back(worker, split)`): a lost block is then redone by several devices at once
instead of one. A tile cut that way is retired: its own late result is counted as a duplicate.
Running attempts are indexed by worker and by tile, the planned queues by length (a steal takes from the
longest) and the lone running attempts by age (speculation copies the oldest), so that every take, result,
loss, steal and speculation costs O(log n) in the number of workers and tiles.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from cleave.gemm.tiles import Tile, cut_block

Outcome = Literal["accepted", "duplicate", "unknown"]
DEFAULT_WINDOW = 2  # tiles in flight per worker (one computing, one arriving); a planned block's pieces stream
MAX_WINDOW = 64  # as many as a plan's pieces of a block (each GEMM's dealing steps through every depth)
DEFAULT_DEFERRED = 8  # weight-gradient GEMMs the PS keeps running beside the backward (`deferred_gemms`)
DEFAULT_AFFINITY_SCAN = 32  # pending tiles looked at when choosing one whose inputs a worker caches


@dataclass
class Attempt:
    tile: int
    attempt: int
    worker: str
    sent_at: float
    order: int = 0  # issue order within the ledger (ties in sent_at)


@dataclass
class GemmLedger:
    tiles: list[Tile]
    owners: list[str | None] | None = None  # the planned device of each tile; None = anyone's
    pending: deque[int] = field(init=False)  # tiles without an owner, or given back (may hold done ones)
    queued: set[int] = field(init=False)  # the tiles of `pending` still to deal
    owned: dict[str, deque[int]] = field(init=False)  # planned tiles not yet handed out, per device
    owned_by: set[str] = field(init=False)
    running: dict[tuple[int, int], Attempt] = field(default_factory=dict)  # (tile, attempt) -> attempt
    by_worker: dict[str, dict[tuple[int, int], Attempt]] = field(default_factory=dict)  # index of running
    by_tile: dict[int, set[int]] = field(default_factory=dict)  # tile -> its running attempts
    done: set[int] = field(default_factory=set)
    issued: list[int] = field(init=False)  # attempts handed out per tile
    holders: list[list[str]] = field(init=False)  # per tile, the worker each attempt went to (for the whole GEMM)
    unissued: int = field(init=False)  # tiles (not retired) never handed out
    retired: set[int] = field(default_factory=set)  # tiles given back and replaced by smaller ones
    parent: dict[int, int] = field(default_factory=dict)  # a tile cut from a retired one -> that one
    kids: dict[int, list[int]] = field(default_factory=dict)  # a retired tile -> the tiles cut from it
    resent: int = 0
    duplicates: int = 0
    copied: int = 0

    def __post_init__(self) -> None:
        self.tiles = list(self.tiles)  # tiles cut from retired ones are appended: never the caller's list
        self.pending, self.owned = deque(), {}
        for t in self.tiles:
            owner = self.owners[t.index] if self.owners else None
            (self.owned.setdefault(owner, deque()) if owner else self.pending).append(t.index)
        self.queued = set(self.pending)
        self.issued = [0] * len(self.tiles)
        self.holders = [[] for _ in self.tiles]
        self.unissued = len(self.tiles)
        self.owned_by = set(self.owned)  # devices the plan gave work: only they steal (others would be slow)
        self._rank = {w: i for i, w in enumerate(self.owned)}  # plan order: ties in a steal go to the first
        self._longest = [(-len(q), self._rank[w], w) for w, q in self.owned.items()]  # lazy max-heap
        heapq.heapify(self._longest)
        self._lone: list[tuple[float, int, int, int]] = []  # (sent_at, order, tile, attempt), lazy min-heap
        self._order = itertools.count()

    @property
    def complete(self) -> bool:
        return len(self.done) + len(self.retired) == len(self.tiles)

    def covered(self, tile: int) -> bool:
        """Whether `tile`'s output is done: by its own result, or by those of the tiles cut from it."""
        return tile in self.done or (tile in self.retired and all(self.covered(k) for k in self.kids[tile]))

    def dealable(self) -> bool:
        """Whether `take` may find a tile: some were never handed out, or some were given back."""
        return self.unissued > 0 or bool(self.queued)

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
        att = Attempt(tile, self.issued[tile], worker, now, next(self._order))
        self.unissued -= self.issued[tile] == 0
        self.issued[tile] += 1
        self.holders[tile].append(worker)
        self.queued.discard(tile)
        key = (tile, att.attempt)
        self.running[key] = att
        self.by_worker.setdefault(worker, {})[key] = att
        self.by_tile.setdefault(tile, set()).add(att.attempt)
        heapq.heappush(self._lone, (att.sent_at, att.order, tile, att.attempt))
        return att

    def drop(self, tile: int, attempt: int) -> Attempt | None:
        """Forget a running attempt (its result came, or will not come); returns it if it was running."""
        att = self.running.pop((tile, attempt), None)
        if att is not None:
            mine = self.by_worker[att.worker]
            del mine[(tile, attempt)]
            if not mine:
                del self.by_worker[att.worker]
            others = self.by_tile[tile]
            others.discard(attempt)
            if not others:
                del self.by_tile[tile]
            elif len(others) == 1:  # the survivor runs alone again: it may be copied
                left = self.running[(tile, next(iter(others)))]
                heapq.heappush(self._lone, (left.sent_at, left.order, tile, left.attempt))
        return att

    def take(self, worker: str, now: float, score: Callable[[Tile], int] | None = None,
             avoid: set[int] | frozenset[int] = frozenset(), busy: bool = False) -> Attempt | None:
        """The next tile for `worker`: its own planned ones, then shared ones (cached inputs first), then,
        if it has nothing in flight (here, nor elsewhere: `busy`), one stolen from the device with the most
        left, so that fast devices take more (a busy worker would only queue the stolen tile behind its own
        work)."""
        own = self.owned.get(worker)
        while own:
            tile = own.popleft()
            if tile not in self.done:
                return self._issue(tile, worker, now)
        tile = self._shared(score, avoid)
        # a device the plan left out is slow for this GEMM: it does not steal
        if tile is None and not busy and not self.count(worker) and (not self.owners or worker in self.owned_by):
            tile = self._steal()
        return None if tile is None else self._issue(tile, worker, now)

    def _steal(self) -> int | None:
        """The last planned tile of the device with the most left (the first in plan order on a tie)."""
        heap = self._longest
        while heap:
            neg, rank, owner = heap[0]
            queue = self.owned.get(owner)
            if not queue:
                heapq.heappop(heap)
                continue
            if len(queue) != -neg:  # stale: the queue has shrunk since
                heapq.heapreplace(heap, (-len(queue), rank, owner))
                continue
            while queue:
                tile = queue.pop()
                if tile not in self.done:
                    heapq.heapreplace(heap, (-len(queue), rank, owner))
                    return tile
        return None

    def _shared(self, score: Callable[[Tile], int] | None, avoid: set[int] | frozenset[int]) -> int | None:
        """The next shared tile (among the first few, the one whose inputs `score` best), never one in `avoid`
        (tiles this worker refused)."""
        while self.pending and self.pending[0] not in self.queued:
            self.pending.popleft()
        if not self.pending:
            return None
        pos, best = None, -1
        for i, t in enumerate(itertools.islice(self.pending, DEFAULT_AFFINITY_SCAN)):
            if t not in self.queued or t in avoid:
                continue
            s = score(self.tiles[t]) if score is not None else 0
            if s > best:
                best, pos = s, i
            if score is None:
                break
        if pos is None:
            return None
        tile = self.pending[pos]
        del self.pending[pos]
        return tile

    def oldest_lone(self) -> Attempt | None:
        """The oldest attempt that runs alone: what `copy_late` would copy."""
        heap = self._lone
        while heap:
            sent_at, _, tile, attempt = heap[0]
            att = self.running.get((tile, attempt))
            if att is not None and len(self.by_tile[tile]) == 1:
                if att.sent_at == sent_at:
                    return att
                heapq.heapreplace(heap, (att.sent_at, att.order, tile, attempt))  # it left the PS later
                continue
            heapq.heappop(heap)  # done, dropped or copied: a survivor is pushed again by `drop`
        return None

    def departed(self, tile: int, attempt: int, at: float) -> None:
        """The attempt left the PS only at `at` (it queued behind other sends): its age counts from then."""
        att = self.running.get((tile, attempt))
        if att is not None and at > att.sent_at:
            att.sent_at = at

    def copy_late(self, worker: str, now: float, min_age_s: float) -> Attempt | None:
        """A second copy, for an idle `worker`, of the oldest tile running alone elsewhere for over
        `min_age_s` (`worker` has nothing in flight, so none of them is its own)."""
        oldest = self.oldest_lone()
        if oldest is None or now - oldest.sent_at <= min_age_s or oldest.worker == worker:
            return None
        self.copied += 1
        return self._issue(oldest.tile, worker, now)

    def issue_extra(self, tile: int, worker: str, now: float) -> Attempt:
        """One more attempt of a tile for `worker` (a verification copy); its result is not assembled."""
        return self._issue(tile, worker, now)

    def was_issued(self, tile: int, attempt: int) -> bool:
        return 0 <= tile < len(self.tiles) and 0 <= attempt < self.issued[tile]

    def issued_to(self, tile: int, attempt: int) -> str | None:
        """The worker (tile, attempt) was handed to, whether it still runs or not (None: never issued): only
        that worker's result for it may count, even after the attempt was given back."""
        return self.holders[tile][attempt] if self.was_issued(tile, attempt) else None

    def finish(self, tile: int, attempt: int) -> Outcome:
        """Record a valid result; only the first for a tile is accepted."""
        if not self.was_issued(tile, attempt):
            return "unknown"
        self.drop(tile, attempt)
        if tile in self.done or tile in self.retired:
            self.duplicates += 1
            return "duplicate"
        self.done.add(tile)
        self.queued.discard(tile)
        for other in list(self.by_tile.get(tile, ())):  # a copy is no longer needed
            self.drop(tile, other)
        return "accepted"

    def retry(self, tile: int, attempt: int) -> None:
        """This attempt will not produce a block (cache miss, refusal): send the tile again, first."""
        if self.drop(tile, attempt) is not None and tile not in self.done:
            self.pending.appendleft(tile)
            self.queued.add(tile)

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
        planned = [k for t in self.owned.pop(worker, ()) if t not in self.done for k in self._cut(t, split)]
        self.pending.extend(planned)
        self.queued.update(tiles)
        self.queued.update(planned)
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
            self.holders.append([])
            self.unissued += 1
            self.parent[kid] = tile
            self.kids[tile].append(kid)
        return self.kids[tile]
