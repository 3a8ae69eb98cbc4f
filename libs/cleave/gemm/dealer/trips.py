"""How long a GEMM's tiles take (pure, part of the dealing core `cleave.gemm.dealer.core`): each member's round
trip per GEMM shape as a moving average, their median over the members (what a copy's threshold is measured
in), and, before any round trip, the median of the tiles' times as the cost model predicts them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sortedcontainers import SortedList

from cleave.gemm.dealer.model import RT_WEIGHT, TYPICAL_SAMPLE, Member, Shape, Work


class RoundTrips:
    """Every member's moving-average round trip per GEMM shape, kept sorted per shape for their median."""

    def __init__(self) -> None:
        self._sorted: dict[Shape, SortedList] = {}

    def record(self, m: Member, shape: Shape, rt: float) -> None:
        """`m` answered a tile of `shape` `rt` seconds after it was sent."""
        old = m.round_trips.get(shape, 0.0)
        new = rt if old == 0 else (1 - RT_WEIGHT) * old + RT_WEIGHT * rt
        trips = self._sorted.setdefault(shape, SortedList())
        if old:
            trips.remove(old)
        trips.add(new)
        m.round_trips[shape] = new

    def forget(self, m: Member) -> None:
        """`m` left: its round trips no longer count."""
        for shape, rt in m.round_trips.items():
            self._sorted[shape].remove(rt)

    def median(self, shape: Shape) -> float | None:
        """The median over the members of their round trip on `shape` (None before any)."""
        trips = self._sorted.get(shape)
        return trips[len(trips) // 2] if trips else None


def median_predicted(members: Mapping[str, Member], work: Work, owners: Sequence[str | None] | None) -> float:
    """The median predicted tile time of `work`: each planned tile on its owner, else on a middle member
    (a sample of TYPICAL_SAMPLE tiles; 0 when no member has a profile)."""
    profiled = [m for m in members.values() if m.profile is not None]
    if not profiled or not work.tiles:
        return 0.0
    middle = profiled[len(profiled) // 2]
    step = max(1, len(work.tiles) // TYPICAL_SAMPLE)
    times = sorted(
        (members[o] if o is not None and members[o].profile is not None else middle)
        .predicted_s(work.tiles[i], work.k, work.b)
        for i, o in ((i, owners[i] if owners else None) for i in range(0, len(work.tiles), step))
    )
    return times[len(times) // 2]
