"""Fan-out groups (pure): the input blocks of a GEMM that several planned workers need, and who needs them.

A planned layout is made of bands: every device of a band gets the band's whole strip of rows of one input
and its own run of the other (`cleave.plan.packing`). Sent naively, a strip shared by d devices leaves the PS d
times. Instead the PS publishes it once on the subject of the group of workers that need it, and NATS
delivers it to each (`SUBJECT_FANOUT`). A group is named by its members, so the same set of workers
subscribes once for every GEMM kind whose bands they share, and again only when a plan changes the set.

Bands rarely agree on where they cut the other input: a device of one band needs columns [0, 483), one of
the next band [0, 141) and [141, 243), and so on, so a whole block is shared by nobody although every column
is needed once per band. Such a block is sent as its segments (`parts`): the maximal runs of columns that
no other planned block starts or ends in. Each segment is a block of its own (same id scheme, so caches and groups
treat it like any other); the worker concatenates the segments of a tile's block, which is the same tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

from cleave.gemm.tiles import Tile
from cleave.schemas import MAX_BLOCK_PARTS

MIN_MEMBERS = 2  # a block that one worker needs goes with its tile


Parts = dict[str, tuple[tuple[str, int, int], ...]]  # block id -> its segments (id, lo, hi), in order


def a_id(key: str, t: Tile) -> str:
    """The id of tile `t`'s block of rows of A (`key` names A's contents)."""
    return f"{key}.{t.r0}.{t.r1}"


def b_id(key: str, t: Tile) -> str:
    """The id of tile `t`'s block of rows of Bᵀ."""
    return f"{key}.{t.c0}.{t.c1}"


def group_name(members: Iterable[str]) -> str:
    """A short, stable subject token for a set of workers."""
    return hashlib.sha1("\n".join(sorted(members)).encode()).hexdigest()[:16]


def parts(tiles: Sequence[Tile], owners: Sequence[str | None] | None, a_key: str = "a",
          b_key: str = "b") -> Parts:
    """The planned input blocks that are better sent as segments: every block that another planned block
    of the same input overlaps without matching it (blocks that only match or miss each other stay whole)."""
    if not owners:
        return {}
    out: Parts = {}
    for key, span in ((a_key, lambda t: (t.r0, t.r1)), (b_key, lambda t: (t.c0, t.c1))):
        out.update(_segments(key, {span(t) for t, owner in zip(tiles, owners, strict=True) if owner is not None}))
    return out


def _segments(key: str, spans) -> Parts:  # noqa: ANN001
    """Cut each range of one input at every end of another range inside it: each segment then is the same
    rows for every block that contains it, so one publish serves all of them."""
    cuts = sorted({x for r in spans for x in r})
    at = {x: i for i, x in enumerate(cuts)}
    out: Parts = {}
    for lo, hi in spans:
        if 1 < at[hi] - at[lo] <= MAX_BLOCK_PARTS:  # one that would need more segments goes whole
            out[f"{key}.{lo}.{hi}"] = tuple((f"{key}.{cuts[i]}.{cuts[i + 1]}", cuts[i], cuts[i + 1])
                                            for i in range(at[lo], at[hi]))
    return out


def inputs(t: Tile, split: Parts | None, a_key: str = "a", b_key: str = "b") -> list[str]:
    """The ids of the blocks tile `t` is sent: its two input blocks, or their segments."""
    out = []
    for block in (a_id(a_key, t), b_id(b_key, t)):
        segs = split.get(block) if split else None
        out += [s[0] for s in segs] if segs else [block]
    return out


def in_step(tiles: Sequence[Tile], owners: Sequence[str | None], a_key: str = "a",
            b_key: str = "b", split: Parts | None = None, window: int = 1) -> dict[str, set[str]]:
    """Every input block -> the planned workers that first need it in the same window of their own pieces
    (`window` pieces in flight at once) as the most others do: a block published to its group reaches every
    member at once, so it goes only to members whose pipeline wants it then (a band's strip: everyone's
    first pieces), the others get it with their tile rather than while they download something they need
    sooner."""
    seen: dict[str, int] = {}
    first: dict[str, dict[int, set[str]]] = {}
    placed: set[tuple[str, str]] = set()  # (block, owner): its first window is taken
    for t, owner in zip(tiles, owners, strict=True):
        if owner is None:
            continue
        n = seen[owner] = seen.get(owner, -1) + 1
        n //= window
        for block in inputs(t, split, a_key, b_key):
            if (block, owner) not in placed:
                placed.add((block, owner))
                first.setdefault(block, {}).setdefault(n, set()).add(owner)
    return {block: max(at.values(), key=len) for block, at in first.items()}


def shared(tiles: Sequence[Tile], owners: Sequence[str | None] | None, a_key: str = "a",
           b_key: str = "b", split: Parts | None = None, window: int = 1) -> dict[str, tuple[str, frozenset[str]]]:
    """Blocks (or segments of `split` blocks) that several planned workers need -> (their group's name, its
    members)."""
    if not owners:
        return {}
    out = {}
    for block, who in in_step(tiles, owners, a_key, b_key, split, window).items():
        if len(who) >= MIN_MEMBERS:
            members = frozenset(who)
            out[block] = (group_name(members), members)
    return out


def layout(tiles: Sequence[Tile], owners: Sequence[str | None] | None, a_key: str = "a", b_key: str = "b",
           window: int = 1) -> tuple[Parts, dict[str, tuple[str, frozenset[str]]]]:
    """How a GEMM's inputs fan out (the PS and the simulator both deal with this): the blocks sent as
    segments, and the blocks or segments published to groups (`window`: the pieces a worker has in flight
    at once, the plan's chunks: a block any of them needs is wanted now)."""
    split = parts(tiles, owners, a_key, b_key)
    return split, shared(tiles, owners, a_key, b_key, split, window)


def memberships(gemms: Iterable[tuple[Sequence[Tile], Sequence[str | None] | None]],
                window: int = 1) -> dict[str, set[str]]:
    """Each worker's fan-out groups over a plan's GEMMs (tiles and owners, as the PS cuts them)."""
    out: dict[str, set[str]] = {}
    for tiles, owners in gemms:
        groups_of(layout(tiles, owners, window=window)[1], out)
    return out


def groups_of(shared: Mapping[str, tuple[str, frozenset[str]]], out: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Each worker's fan-out groups in one GEMM's `shared` (`layout`'s second part), added to `out`."""
    out = {} if out is None else out
    for name, members in shared.values():
        for w in members:
            out.setdefault(w, set()).add(name)
    return out
