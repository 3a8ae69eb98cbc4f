"""What the dealing core reads and returns: its policy, its view of each worker, the GEMM to deal, the
tiles to send, and the recoveries it records (`cleave.gemm.dealer.core.Dealer` decides with them)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cleave.gemm.ledger import DEFAULT_WINDOW, GemmLedger
from cleave.gemm.tiles import Tile
from cleave.plan.profile import tile_seconds
from cleave.schemas import DeviceProfile

Shape = tuple[int, int, int]  # (m, n, k) of a GEMM
DEFAULT_CACHE_BYTES = 128 * 1024**2  # the worker's input-block cache (its default), mirrored here
DEFAULT_SUSPECT_RETRY = 3.0  # a suspect worker still in the plan gets tiles again after 3 tile timeouts
RT_WEIGHT = 0.2  # weight of a new round trip in a worker's moving average
JOINS_KEPT = 2  # a worker stays in the fan-out groups of its latest two joins (the PS's and the worker's rule)
TYPICAL_SAMPLE = 256  # tiles sampled for the median predicted tile time
DEFAULT_INFLIGHT_S = 2.0  # with a byte limit: no more in flight to a worker than 2 s of its downlink
DEFAULT_BEATEN = 3  # a worker whose tiles copies finish first this many times in a row is suspect
DEFAULT_COPY_SHARE = 0.25  # copies of a GEMM's late tiles add at most about a quarter to the bytes it sends
CHECK_BYTES = 64 * 1024  # a link check's request: dozens of TCP segments, so a connection backing off does not pass
LEFT_KEPT = 100_000  # ids of workers that left, remembered so that a returning one proves its link first


@dataclass(frozen=True)
class Policy:
    """The PS's dealing knobs (`cleave_ps.settings.PsSettings` builds one; the simulator uses these)."""

    window: int = DEFAULT_WINDOW  # tiles in flight per worker (a planned block's pieces: the plan's chunks)
    tile_timeout_s: float = 1.0  # a worker silent this long with tiles in flight is presumed lost ...
    timeout_factor: float = 4.0  # ... or this many times its usual tile time, if longer
    speculate_factor: float = 3.0  # copy a tile running this many usual round trips; 0 = never
    speculate_min_s: float = 0.2  # ... and at least this long
    copy_share: float = DEFAULT_COPY_SHARE  # ... while a GEMM's copies sent under this share of its other bytes
    tick_s: float = 0.05  # how often the PS checks: the smallest gap between two speculation checks
    suspect_retry: float = DEFAULT_SUSPECT_RETRY  # x tile_timeout_s until a suspect is tried again
    max_inflight_bytes: int | None = None  # bytes sent to a worker and not yet answered, past its first
    # tile; None = no limit (the PS sets it under the NATS server's max_pending, see docs/architecture.md)
    beaten_limit: int = DEFAULT_BEATEN  # 0 = never suspect a worker for being beaten by copies


@dataclass
class Member:
    """The dealer's view of one worker."""

    id: str
    cache_bytes: int = DEFAULT_CACHE_BYTES
    profile: DeviceProfile | None = None  # what it registered with: predicts its tile times
    known: OrderedDict[str, int] = field(default_factory=OrderedDict)  # mirror of its block LRU
    known_bytes: int = 0
    last_progress: float = 0.0
    round_trips: dict[Shape, float] = field(default_factory=dict)  # moving average per GEMM shape
    suspect: bool = False
    suspect_since: float = 0.0
    inflight_bytes: int = 0
    token: int = 0  # invalidates stale deadline entries
    proven: bool = True  # False for a worker that came back, until a round trip over its downlink succeeded
    beaten: int = 0  # its tiles in a row that a copy on another worker finished first

    def remember(self, block_id: str, nbytes: int) -> None:
        if nbytes > self.cache_bytes or block_id in self.known:
            return
        while self.known_bytes + nbytes > self.cache_bytes:
            self.known_bytes -= self.known.popitem(last=False)[1]
        self.known[block_id] = nbytes
        self.known_bytes += nbytes

    def forget(self, block_id: str) -> None:
        self.known_bytes -= self.known.pop(block_id, 0)

    def over_budget(self, cap: int | None) -> bool:
        """Whether one more tile would put more bytes in flight to it than it may hold: `cap`, or two seconds
        of its downlink when that is less (None: no limit)."""
        if cap is None:
            return False
        if self.profile is not None:
            cap = min(cap, int(DEFAULT_INFLIGHT_S * self.profile.downlink_bytes_per_s))
        return self.inflight_bytes >= cap

    def predicted_s(self, t: Tile, k: int, b: int) -> float:
        """The cost model's time for tile `t` alone on this device (0 when its profile is unknown)."""
        return 0.0 if self.profile is None else tile_seconds(self.profile, t.rows, t.cols, k, b)


@dataclass(frozen=True)
class Work:
    """One GEMM run to deal: C[m, n] = A[m, k] · Bᵀ[n, k] cut into `tiles` (each planned for `owners[i]`,
    or anyone's); input blocks are named `<a_key>.<r0>.<r1>` and `<b_key>.<c0>.<c1>`."""

    seq: int  # the GEMM run's number in the PS epoch: results of any other run are fenced off
    m: int
    n: int
    k: int
    b: int  # bytes per element that travel
    tiles: Sequence[Tile]
    owners: Sequence[str | None] | None = None
    chunks: int = 1  # the plan's pieces per block: a worker's planned pieces stream this many at once
    a_key: str = "a"
    b_key: str = "b"
    shared: Mapping[str, tuple[str, frozenset[str]]] | None = None  # block -> fan-out group (`cleave.gemm.fanout`)
    parts: Mapping[str, tuple[tuple[str, int, int], ...]] | None = None  # block -> its segments (`fanout.parts`)

    @property
    def shape(self) -> Shape:
        return (self.m, self.n, self.k)


class BlockSend(NamedTuple):
    """An input block of a tile: its id and range, and whether its bytes travel with it (`data`: not cached
    there), or come on the fan-out subject of group `fanout` (published with this send when `publish`). A
    tuple: the dealer makes one per block and segment of every tile it deals (a third of a frozen
    dataclass's cost)."""

    id: str
    lo: int
    hi: int
    data: bool
    fanout: str = ""
    publish: bool = False
    parts: tuple[BlockSend, ...] = ()  # its segments, each reaching the worker as above (then `data` is False)

    def leaves(self) -> tuple[BlockSend, ...]:
        """What travels: the block itself, or its segments."""
        return self.parts or (self,)

    def rows(self, flag: str) -> int:
        """Rows of its leaves whose `flag` ("data" or "publish") is set."""
        return sum(leaf.hi - leaf.lo for leaf in self.leaves() if getattr(leaf, flag))


@dataclass(frozen=True)
class Send:
    """Send tile `tile` (attempt `attempt`) to `worker` with blocks `a` (rows of A) and `b` (rows of Bᵀ)."""

    worker: str
    tile: Tile
    attempt: int
    a: BlockSend
    b: BlockSend
    nbytes: int  # input bytes that travel with the tile
    pushed: int = 0  # input bytes published to a fan-out group with it (once for all its members)
    seq: int = 0  # the GEMM run it belongs to (`Work.seq`)


@dataclass
class Recovery:
    """A worker presumed lost during a GEMM: its tiles, when it went silent, when that was noticed, when its
    tiles were sent again and when the last of them was done."""

    worker: str
    cause: str
    silent_since: float
    detected_at: float
    tiles: set[int]
    count: int
    redispatched_at: float | None = None
    done_at: float | None = None
    seq: int = 0  # the GEMM run whose tiles these were


class ProveLink(NamedTuple):
    """Prove `worker`'s downlink (a small round trip over its tile connection) before it is dealt tiles: it
    came back to the plan, or from suspicion. Its tiles follow once the caller reports `Dealer.proved`."""

    worker: str


class WorkerLost(NamedTuple):
    """`worker` is presumed lost (`cause`: a missed deadline, copies beat it, it left the plan, it lied):
    what it was asked to do will not come, and its tiles were given back."""

    worker: str
    cause: str


class TilesLost(NamedTuple):
    """A loss of tiles in one GEMM (its `Recovery`, open until they are all done again)."""

    recovery: Recovery


class RecoveryDone(NamedTuple):
    """Every tile of a loss is done again (`recovery.done_at` says when)."""

    recovery: Recovery


Instruction = Send | ProveLink | WorkerLost | TilesLost | RecoveryDone  # what the dealer tells its caller to do


@dataclass
class Deal:
    """One GEMM being dealt (several may be at once, see `Dealer.begin`) and what the dealer tracks of it."""

    work: Work
    ledger: GemmLedger
    priority: int = 0  # lower is dealt first: the GEMM on the critical path
    typical: float = 0.0  # its median predicted tile time
    recoveries: list[Recovery] = field(default_factory=list)  # its losses, open and closed
    bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (tile, attempt) -> input bytes it carried
    sent_bytes: int = 0  # input bytes its tiles carried or published, copies aside ...
    copy_bytes: int = 0  # ... and those its speculative copies did (`Policy.copy_share` bounds them)
    leaving: set[tuple[int, int]] = field(default_factory=set)  # (tile, attempt) dealt, not yet left the PS
    published: dict[str, str] = field(default_factory=dict)  # its blocks published so far -> their group
    refused: dict[int, set[str]] = field(default_factory=dict)  # tile -> workers that refused it
    inline: set[tuple[str, str]] = field(default_factory=set)  # (worker, block) it said it lacked: sent with its tiles
    # a segmented block's parts as a worker caching every segment gets them (`inputs.block_input`); dropped
    # when one of its segments is published (`parents`: segment -> the blocks whose cached parts name it)
    cached_parts: dict[str, tuple[BlockSend, ...]] = field(default_factory=dict)
    parents: dict[str, list[str]] = field(default_factory=dict)

    @property
    def rank(self) -> tuple[int, int]:
        return (self.priority, self.work.seq)

    def sent(self, tile: int, attempt: int, nbytes: int, copy: bool, now: float) -> None:
        """An attempt dealt with `nbytes` of inputs (with it or published): owed until answered, to leave the PS,
        counted against the copies' share if it is one; a lost tile dealt again is re-dispatched now."""
        self.bytes[(tile, attempt)] = nbytes
        self.leaving.add((tile, attempt))
        if copy:
            self.copy_bytes += nbytes
        else:
            self.sent_bytes += nbytes
        for rec in self.recoveries:
            if tile in rec.tiles:
                rec.redispatched_at = now

    def closed(self, tile: int, now: float) -> list[Recovery]:
        """`tile` is done: the losses that were waiting for it alone, now made good."""
        out = []
        for rec in self.recoveries:
            if rec.done_at is None and tile in rec.tiles:
                rec.tiles.discard(tile)
                if not rec.tiles:
                    rec.done_at = now
                    out.append(rec)
        return out

    def may_copy(self, share: float) -> bool:
        """Whether its copies so far leave room for another: tiles that look late because they wait behind a
        saturated PS link must not be copied over that link again and again (a copy of cached inputs adds nothing)."""
        return self.copy_bytes <= share * self.sent_bytes
