"""How a dealt tile's input blocks reach its worker (pure, part of the dealing core `cleave.gemm.dealer.core`).

A block the worker caches (by the dealer's mirror of its LRU) is named only; one in a fan-out group the
worker has joined is published to the group when the first member needs it (`cleave.gemm.fanout`), and every
member then caches it; anything else travels with the tile. A block that overlaps others without matching
goes as its segments (`Work.parts`), each reaching the worker that way. `score` ranks shared tiles by the
rows of their inputs a worker already caches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping

from cleave.gemm.dealer.model import JOINS_KEPT, BlockSend, Deal, Member
from cleave.gemm.fanout import a_id, b_id
from cleave.gemm.tiles import Tile


class Groups:
    """The fan-out groups each worker has subscribed to: those of its latest JOINS_KEPT joins (a GEMM in
    flight when a plan changes goes on with the groups it began with); it left any older ones."""

    def __init__(self) -> None:
        self.joined: dict[str, set[str]] = {}  # worker -> the groups it is in
        self._joins: dict[str, deque[set[str]]] = {}  # worker -> the groups of its latest joins

    def join(self, worker: str, groups: Iterable[str]) -> None:
        joins = self._joins.setdefault(worker, deque(maxlen=JOINS_KEPT))
        joins.append(set(groups))
        self.joined[worker] = set().union(*joins)

    def forget(self, worker: str) -> None:
        self.joined.pop(worker, None)
        self._joins.pop(worker, None)


def score(deal: Deal, m: Member) -> Callable[[Tile], int] | None:
    """Rows of a tile's inputs that `m` caches (None when it caches nothing: any tile will do)."""
    if not m.known:
        return None
    work, known = deal.work, m.known
    if work.parts:
        return lambda t: _known(deal, known, a_id(work.a_key, t), t.rows) + _known(deal, known, b_id(work.b_key, t), t.cols)
    return lambda t: (a_id(work.a_key, t) in known) * t.rows + (b_id(work.b_key, t) in known) * t.cols


def _known(deal: Deal, known: Mapping[str, int], block_id: str, rows: int) -> int:
    """Rows of a block (or of its segments) that a member caches."""
    segs = deal.work.parts.get(block_id)
    if not segs:
        return rows * (block_id in known)
    return sum(hi - lo for sid, lo, hi in segs if sid in known)


def block_input(deal: Deal, m: Member, block_id: str, lo: int, hi: int, joined: Mapping[str, set[str]],
                members: Mapping[str, Member]) -> BlockSend:
    """How an input block of a tile reaches `m`: whole, or as its segments (`Work.parts`)."""
    row = deal.work.k * deal.work.b
    segs = deal.work.parts.get(block_id) if deal.work.parts else None
    if not segs:
        return _block(deal, m, block_id, lo, hi, (hi - lo) * row, joined, members)
    known = m.known
    if all(sid in known for sid, _, _ in segs):  # the usual case: what `_block` says of each, made once
        for sid, _, _ in segs:
            known.move_to_end(sid)
        return BlockSend(block_id, lo, hi, False, parts=_cached_parts(deal, block_id, segs))
    return BlockSend(block_id, lo, hi, False, parts=tuple(
        _block(deal, m, sid, slo, shi, (shi - slo) * row, joined, members) for sid, slo, shi in segs))


def _cached_parts(deal: Deal, block_id: str, segs: tuple[tuple[str, int, int], ...]) -> tuple[BlockSend, ...]:
    """The parts of a block all of whose segments a worker caches (each named, with its group if it was
    published: it may still be on its way), shared by every worker that caches them all."""
    parts = deal.cached_parts.get(block_id)
    if parts is None:
        parts = deal.cached_parts[block_id] = tuple(
            BlockSend(sid, slo, shi, False, deal.published.get(sid, "")) for sid, slo, shi in segs)
        for sid, _, _ in segs:
            if sid not in deal.published:
                deal.parents.setdefault(sid, []).append(block_id)
    return parts


def _block(deal: Deal, m: Member, block_id: str, lo: int, hi: int, nbytes: int, joined: Mapping[str, set[str]],
           members: Mapping[str, Member]) -> BlockSend:
    """How a block reaches `m`: it caches it already, or it comes from its fan-out group (published now
    if it is the first of the group to need it), or it travels with the tile."""
    if block_id in m.known:  # (a published one may still be on its way: the worker waits for it)
        m.known.move_to_end(block_id)
        return BlockSend(block_id, lo, hi, False, deal.published.get(block_id, ""))
    group = deal.work.shared.get(block_id) if deal.work.shared else None
    if (group is not None and group[0] in joined.get(m.id, ()) and nbytes <= m.cache_bytes
            and (m.id, block_id) not in deal.inline):
        name, group_members = group
        first = block_id not in deal.published
        if first:  # every subscribed member receives it, and caches it
            deal.published[block_id] = name
            for parent in deal.parents.pop(block_id, ()):
                deal.cached_parts.pop(parent, None)
            for wid in group_members:
                if wid in members and name in joined.get(wid, ()):
                    members[wid].remember(block_id, nbytes)
        return BlockSend(block_id, lo, hi, False, name, first)
    m.remember(block_id, nbytes)
    return BlockSend(block_id, lo, hi, True)
