"""What each worker delivers, as the PS sees it (pure): the time its accepted tiles kept it busy against what
the cost model predicted for them on the profile it was planned with; reported to the scheduler now and then
(`Observed`), which corrects a profile that claims far more than its worker delivers.

A tile's busy time runs from when it left the PS, or from the worker's previous result if that came later
(a worker with several tiles in flight is busy with one at a time): for a worker that streams its tiles this
is the time between its results, for an idle one its round trip. A worker whose tile another worker's copy
finished first (`beaten`) is tallied when its own block comes after all (`late`), or, if it has not come when
the GEMM ends, as delivered then (`unanswered`: its tile kept it busy at least that long), so a worker too
slow to ever win a race against the copies of its tiles is still seen for what it delivers, even when its
blocks come after their GEMM or never.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.schemas import Observed, WorkerObserved

DEFAULT_REPORT_S = 5.0  # a report at most this often
MIN_TILES = 8  # a worker is reported once it delivered this many tiles since its last report ...
MIN_BUSY_S = 1.0  # ... and was busy this long
MAX_BEATEN = 4096  # beaten attempts remembered until their own block comes (the oldest forgotten first)


@dataclass
class WorkerTally:
    tiles: int = 0
    busy_s: float = 0.0
    predicted_s: float = 0.0
    last: float = 0.0  # when its last result came
    flops: float = 0.0  # of the profile the predictions were made with


class Throughput:
    def __init__(self, now: float, every_s: float = DEFAULT_REPORT_S) -> None:
        self.by: dict[str, WorkerTally] = {}
        self.beaten_by: dict[tuple, tuple[str, float, float, float]] = {}  # attempt -> (worker, sent_at, predicted_s, flops)
        self.every_s, self.reported_at = every_s, now

    def accepted(self, worker: str, sent_at: float, now: float, predicted_s: float, flops: float) -> None:
        """`worker`'s block for a tile that left the PS at `sent_at` was accepted at `now`."""
        t = self.by.setdefault(worker, WorkerTally())
        if t.flops != flops:  # planned with another profile since: its predictions start afresh
            t.tiles, t.busy_s, t.predicted_s, t.flops = 0, 0.0, 0.0, flops
        t.tiles += 1
        t.busy_s += max(0.0, now - max(sent_at, t.last))
        t.predicted_s += predicted_s
        t.last = now

    def beaten(self, attempt: tuple, worker: str, sent_at: float, predicted_s: float, flops: float) -> None:
        """`worker`'s `attempt` (any hashable name) of a tile that left the PS at `sent_at` was beaten by another
        worker's block: its own counts when it comes (`late`)."""
        self.beaten_by[attempt] = (worker, sent_at, predicted_s, flops)
        while len(self.beaten_by) > MAX_BEATEN:
            del self.beaten_by[next(iter(self.beaten_by))]

    def late(self, attempt: tuple, worker: str, now: float) -> None:
        """`worker`'s own block for a beaten `attempt` came at `now`: tallied as a delivery."""
        got = self.beaten_by.pop(attempt, None)
        if got is not None and got[0] == worker:
            self.accepted(worker, got[1], now, got[2], got[3])

    def unanswered(self, seq: int, now: float) -> None:
        """GEMM `seq` (the first element of its attempts' names) ended at `now`: its beaten attempts whose own
        blocks have not come are tallied as delivered now, a lower bound on what they took."""
        for attempt in [a for a in self.beaten_by if a[0] == seq]:
            worker, sent_at, predicted_s, flops = self.beaten_by.pop(attempt)
            self.accepted(worker, sent_at, now, predicted_s, flops)

    def forget(self, worker: str) -> None:
        self.by.pop(worker, None)
        self.beaten_by = {k: v for k, v in self.beaten_by.items() if v[0] != worker}

    def report(self, job: str, now: float, wall: float) -> Observed | None:
        """The workers with enough delivered since their last report (their tallies start afresh), at most every
        `every_s`; None when there is nothing to say yet."""
        if now - self.reported_at < self.every_s:
            return None
        self.reported_at = now
        out = []
        for worker, t in self.by.items():
            if t.tiles >= MIN_TILES and t.busy_s >= MIN_BUSY_S and t.predicted_s > 0:
                out.append(WorkerObserved(worker_id=worker, tiles=t.tiles, observed_s=t.busy_s,
                                          predicted_s=t.predicted_s, flops=t.flops))
                t.tiles, t.busy_s, t.predicted_s = 0, 0.0, 0.0
        return Observed(job=job, at=wall, workers=tuple(out)) if out else None
