"""Fan-out groups (pure): the input blocks of a GEMM that several planned workers need, and who needs them.

A planned layout is made of bands: every device of a band gets the band's whole strip of rows of one input
and its own run of the other (`cleave.packing`). Sent naively, a strip shared by d devices leaves the PS d
times. Instead the PS publishes it once on the subject of the group of workers that need it, and NATS
delivers it to each (`SUBJECT_FANOUT`). A group is named by its members, so the same set of workers
subscribes once for every GEMM kind whose bands they share, and again only when a plan changes the set.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from cleave.tiles import Tile

MIN_MEMBERS = 2  # a block that one worker needs goes with its tile


def a_id(key: str, t: Tile) -> str:
    """The id of tile `t`'s block of rows of A (`key` names A's contents)."""
    return f"{key}.{t.r0}.{t.r1}"


def b_id(key: str, t: Tile) -> str:
    """The id of tile `t`'s block of rows of Bᵀ."""
    return f"{key}.{t.c0}.{t.c1}"


def group_name(members: Iterable[str]) -> str:
    """A short, stable subject token for a set of workers."""
    return hashlib.sha1("\n".join(sorted(members)).encode()).hexdigest()[:16]


def in_step(tiles: Sequence[Tile], owners: Sequence[str | None], a_key: str = "a",
            b_key: str = "b") -> dict[str, set[str]]:
    """Every input block -> the planned workers that first need it at the same point of their own pieces as
    the most others do: a block published to its group reaches every member at once, so it goes only to
    members whose pipeline wants it then (a band's strip: everyone's first piece), the others get it with
    their tile rather than while they download something they need sooner."""
    seen: dict[str, int] = {}
    first: dict[str, dict[int, set[str]]] = {}
    for t, owner in zip(tiles, owners, strict=True):
        if owner is None:
            continue
        n = seen[owner] = seen.get(owner, -1) + 1
        for block in (a_id(a_key, t), b_id(b_key, t)):
            at = first.setdefault(block, {})
            if not any(owner in who for who in at.values()):
                at.setdefault(n, set()).add(owner)
    return {block: max(at.values(), key=len) for block, at in first.items()}


def shared(tiles: Sequence[Tile], owners: Sequence[str | None] | None, a_key: str = "a",
           b_key: str = "b") -> dict[str, tuple[str, frozenset[str]]]:
    """Blocks that several planned workers need -> (their group's name, its members)."""
    if not owners:
        return {}
    out = {}
    for block, who in in_step(tiles, owners, a_key, b_key).items():
        if len(who) >= MIN_MEMBERS:
            members = frozenset(who)
            out[block] = (group_name(members), members)
    return out


def memberships(gemms: Iterable[tuple[Sequence[Tile], Sequence[str | None] | None]]) -> dict[str, set[str]]:
    """Each worker's fan-out groups over a plan's GEMMs (tiles and owners, as the PS cuts them)."""
    out: dict[str, set[str]] = {}
    for tiles, owners in gemms:
        for name, members in shared(tiles, owners).values():
            for w in members:
                out.setdefault(w, set()).add(name)
    return out
