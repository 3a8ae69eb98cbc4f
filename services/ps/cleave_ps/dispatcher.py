"""Deals the tiles of one GEMM at a time to the workers of the current plan and assembles the results.

Runs on the event loop. Fast workers take more (each has a small window of tiles in flight and gets a new
one per result). A worker that makes no progress within its deadline is presumed lost and its tiles go
back to the queue; a late, duplicate or invalid result is counted and never reaches the output.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from cleave import codec, dealing, tiles
from cleave.bus import Bus
from cleave.errors import StepAborted, StepSpoiled
from cleave.ledger import Attempt, GemmLedger
from cleave.schemas import (
    SUBJECT_RESULTS,
    SUBJECT_TILES,
    BlockRef,
    Event,
    Plan,
    TensorData,
    TileResult,
    TileTask,
)
from cleave_ps.settings import PsSettings
from cleave_ps.verify import Check, Verifier

log = structlog.get_logger("ps")
DEFAULT_WAIT_LOG_S = 5.0
DEFAULT_BLOCK = 256
SUSPECT_RETRY_FACTOR = 3  # a suspect worker still in the plan gets tiles again after 3 tile timeouts


@dataclass
class WorkerSlot:
    worker_id: str
    cache_bytes: int
    known: OrderedDict[str, int] = field(default_factory=OrderedDict)  # mirror of the worker's block LRU
    known_bytes: int = 0
    last_progress: float = 0.0
    round_trips: dict[tuple[int, int, int], float] = field(default_factory=dict)  # moving average of a tile's
    # send-to-result time per GEMM shape (m, n, k): tiles of different kinds differ 25-fold
    suspect: bool = False
    suspect_since: float = 0.0

    def remember(self, block_id: str, nbytes: int) -> None:
        if nbytes > self.cache_bytes or block_id in self.known:
            return
        while self.known_bytes + nbytes > self.cache_bytes:
            self.known_bytes -= self.known.popitem(last=False)[1]
        self.known[block_id] = nbytes
        self.known_bytes += nbytes

    def forget(self, block_id: str) -> None:
        self.known_bytes -= self.known.pop(block_id, 0)


@dataclass
class Counters:
    tiles: int = 0
    resent: int = 0
    dropped: int = 0
    rejected: int = 0
    cache_misses: int = 0
    speculated: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    gemm_s: float = 0.0  # wall time spent in distributed GEMMs
    planned_gemm_s: float = 0.0  # the plan's makespans of the GEMMs run
    unplanned: int = 0  # GEMMs run without a planned layout (dealt as a uniform grid)
    recoveries: list[Event] = field(default_factory=list)


@dataclass
class Recovery:
    worker: str
    cause: str
    silent_since: float
    detected_at: float
    tiles: set[int]
    redispatched_at: float | None = None


@dataclass
class GemmRun:
    step: int
    op: int
    name: str
    a: torch.Tensor
    bt: torch.Tensor
    a_uid: int
    b_uid: int
    ledger: GemmLedger
    out: torch.Tensor
    done: asyncio.Event = field(default_factory=asyncio.Event)
    blocks: dict[str, TensorData] = field(default_factory=dict)
    recoveries: list[Recovery] = field(default_factory=list)
    spoiled: str = ""  # a worker found lying during this GEMM
    expected_s: float = 0.0  # the plan's makespan for this GEMM (0: no prediction)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.a.shape[0], self.bt.shape[0], self.a.shape[1]


def block_shape(m: int, n: int, plan: Plan | None, workers: int) -> tuple[int, int]:
    """The plan's block shape, halved (larger side first) until every worker can get a tile."""
    rows, cols = (plan.tile_rows, plan.tile_cols) if plan else (DEFAULT_BLOCK, DEFAULT_BLOCK)
    return tiles.fit_block(m, n, rows, cols, workers)


class Dispatcher:
    def __init__(self, bus: Bus, job_id: str, epoch: int, s: PsSettings) -> None:
        self.bus, self.job_id, self.epoch, self.s = bus, job_id, epoch, s
        self.reply = SUBJECT_RESULTS.format(job=job_id, epoch=epoch, worker_id="{worker_id}")  # one per worker
        self.workers: dict[str, WorkerSlot] = {}
        self.plan: Plan | None = None
        self.run: GemmRun | None = None
        self.c = Counters()
        self._uids: dict[tuple, tuple[int, torch.Tensor]] = {}
        self._next_uid = 0
        self.stopping = False
        self.verifier = Verifier(s.verify_fraction, seed=epoch)
        # the approximate mode: input blocks travel in half precision (results stay float32)
        self.tile_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[s.tile_dtype]
        self.faulty: set[str] = set()  # workers caught returning wrong blocks: never dealt to again

    # ---- plan ----------------------------------------------------------------------------------------
    async def set_plan(self, plan: Plan) -> None:
        self.plan = plan
        now = time.monotonic()
        ids = {w.worker_id for w in plan.workers}
        for w in plan.workers:
            if w.worker_id not in self.workers and w.worker_id not in self.faulty:
                self.workers[w.worker_id] = WorkerSlot(w.worker_id, w.cache_bytes, last_progress=now)
        for gone in set(self.workers) - ids:
            self._lose(gone, now, cause="heartbeat_timeout", silent_since=self.workers[gone].last_progress)
            del self.workers[gone]
        log.info("plan_applied", version=plan.version, workers=len(ids), reason=plan.reason)
        await self._fill_all()

    # ---- one GEMM ------------------------------------------------------------------------------------
    def new_step(self) -> None:
        self._uids.clear()  # block ids are only reused within a step

    def _uid(self, t: torch.Tensor) -> int:
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t._version, t.dtype)
        hit = self._uids.get(key)
        if hit is None:
            self._next_uid += 1
            hit = self._uids[key] = (self._next_uid, t)  # holding t keeps its address from being reused
        return hit[0]

    async def gemm(self, a: torch.Tensor, bt: torch.Tensor, step: int, op: int, name: str) -> torch.Tensor:
        sent = self.tile_dtype or a.dtype  # the bytes per element that travel
        grid, owners, expected_s = self._tiling(a.shape[0], bt.shape[0], a.shape[1], sent.itemsize)
        self.verifier.new_gemm()
        run = GemmRun(step, op, name, a, bt, self._uid(a), self._uid(bt), GemmLedger(grid, owners),
                      torch.empty(a.shape[0], bt.shape[0], dtype=a.dtype), expected_s=expected_s)
        self.run = run
        started = waited = time.monotonic()
        try:
            await self._fill_all()
            while not run.ledger.complete or self.verifier.checks:
                if self.stopping:
                    raise StepAborted("the parameter server is stopping")
                if run.spoiled:
                    raise StepSpoiled(f"worker {run.spoiled} returned a wrong block; step {step} is redone")
                try:
                    await asyncio.wait_for(run.done.wait(), self.s.tick_s)
                except TimeoutError:
                    await self._check_progress()
                    if not self._live() and time.monotonic() - waited > DEFAULT_WAIT_LOG_S:
                        waited = time.monotonic()
                        log.warning("waiting_for_workers", step=step, gemm=name,
                                    pending=len(run.ledger.tiles) - len(run.ledger.done))
        finally:
            self.run = None
        wall = time.monotonic() - started
        log.debug("gemm_done", step=step, gemm=name, m=a.shape[0], n=bt.shape[0], k=a.shape[1], tiles=len(grid),
                  wall_s=round(wall, 4), planned_s=round(expected_s, 4), resent=run.ledger.resent,
                  speculated=run.ledger.speculated)
        self.c.gemm_s += wall
        self.c.planned_gemm_s += expected_s
        self.c.unplanned += owners is None
        self.c.tiles += len(grid)
        self.c.resent += run.ledger.resent
        self.c.speculated += run.ledger.speculated
        self.c.dropped += run.ledger.duplicates
        return run.out

    def _tiling(self, m: int, n: int, k: int, b: int) -> tuple[list[tiles.Tile], list[str | None] | None, float]:
        """The plan's blocks for this shape, cut as `tiles.cut_block` says, and the planned makespan; else a
        uniform grid (and 0: nothing predicted)."""
        plan = self.plan
        layout = next((g for g in plan.gemms if (g.m, g.n, g.k) == (m, n, k)), None) if plan else None
        if layout is None:
            rows, cols = block_shape(m, n, plan, len(self._live()))
            return tiles.grid(m, n, rows, cols), None, 0.0
        boxes, owners = [], []
        for i, owner in enumerate(layout.owners):
            box = tuple(layout.boxes[4 * i : 4 * i + 4])
            slot = self.workers.get(owner)
            cache = slot.cache_bytes if slot is not None else 0
            parts = dealing.cut(box, k, b, plan.tile_rows, plan.tile_cols, plan.chunks, cache)
            boxes += parts
            owners += [owner if owner in self.workers else None] * len(parts)
        return tiles.from_boxes(boxes), owners, layout.makespan_s

    @property
    def _chunks(self) -> int:
        """The plan's pieces per block (1 without a plan)."""
        return self.plan.chunks if self.plan else 1

    def _live(self) -> list[WorkerSlot]:
        now = time.monotonic()
        for w in self.workers.values():
            # still in the plan (its heartbeats go on) well after it missed a deadline: try it again
            if w.suspect and now - w.suspect_since > SUSPECT_RETRY_FACTOR * self.s.tile_timeout_s:
                w.suspect = False
        return [w for w in self.workers.values() if not w.suspect]

    async def _fill_all(self) -> None:
        """Deal round-robin: every live worker gets one tile before any gets a second."""
        depth = 1
        while depth <= max(self.s.window, self._chunks):
            for w in list(self._live()):
                await self._fill(w, depth)
            depth += 1

    async def _fill(self, slot: WorkerSlot, depth: int | None = None) -> None:
        run = self.run
        if run is None or slot.suspect or slot.worker_id not in self.workers:
            return
        w = slot.worker_id
        while run.ledger.count(w) < min(depth or math.inf, run.ledger.room(w, self.s.window, self._chunks)):
            att = run.ledger.take(w, time.monotonic(), lambda t: self._cached_score(slot, run, t))
            if att is None:
                att = self._speculate(slot, run)
            if att is None:
                return
            if not slot.suspect and run.ledger.count(w) == 1:
                slot.last_progress = time.monotonic()  # the clock of an idle worker starts now
            await self._send(slot, run, att)

    def _speculate(self, slot: WorkerSlot, run: GemmRun) -> Attempt | None:
        """An idle worker takes a copy of a tile that runs far past the usual round trip (first wins)."""
        if self.s.speculate_factor <= 0 or run.ledger.count(slot.worker_id):
            return None
        trips = sorted(r for w in self.workers.values() if (r := w.round_trips.get(run.shape, 0.0)) > 0)
        usual = trips[len(trips) // 2] if trips else self.s.tile_timeout_s
        return run.ledger.speculate(slot.worker_id, time.monotonic(),
                                    max(self.s.speculate_min_s, self.s.speculate_factor * usual))

    def _ids(self, run: GemmRun, t: tiles.Tile) -> tuple[str, str]:
        return f"{self.epoch}.{run.a_uid}.{t.r0}.{t.r1}", f"{self.epoch}.{run.b_uid}.{t.c0}.{t.c1}"

    def _cached_score(self, slot: WorkerSlot, run: GemmRun, t: tiles.Tile) -> int:
        a_id, b_id = self._ids(run, t)
        return (a_id in slot.known) * t.rows + (b_id in slot.known) * t.cols

    def _block(self, run: GemmRun, slot: WorkerSlot, block_id: str, src: torch.Tensor, lo: int, hi: int) -> BlockRef:
        if block_id in slot.known:
            slot.known.move_to_end(block_id)
            return BlockRef(id=block_id)
        data = run.blocks.get(block_id)
        if data is None:
            block = src[lo:hi] if self.tile_dtype is None else src[lo:hi].to(self.tile_dtype)
            data = run.blocks[block_id] = codec.tensor_to_data(block)
        slot.remember(block_id, len(data.data))
        return BlockRef.model_construct(id=block_id, tensor=data)

    async def _send(self, slot: WorkerSlot, run: GemmRun, att: Attempt) -> None:
        t = run.ledger.tiles[att.tile]
        a_id, b_id = self._ids(run, t)
        task = TileTask.model_construct(
            job=self.job_id, epoch=self.epoch, step=run.step, op=run.op, tile=t.index, attempt=att.attempt,
            a=self._block(run, slot, a_id, run.a, t.r0, t.r1), b=self._block(run, slot, b_id, run.bt, t.c0, t.c1),
            reply=self.reply.format(worker_id=slot.worker_id), sent_at=time.time(),
        )
        try:
            self.c.bytes_down += await self.bus.publish(SUBJECT_TILES.format(worker_id=slot.worker_id), task, compress=False)
        except Exception as e:  # disconnected: the deadline check will hand the tile to someone else
            log.warning("tile_not_sent", worker_id=slot.worker_id, error=repr(e))
        for rec in run.recoveries:
            if att.tile in rec.tiles:
                rec.redispatched_at = time.monotonic()

    # ---- results -------------------------------------------------------------------------------------
    async def on_result(self, msg: TileResult, nbytes: int) -> None:
        self.c.bytes_up += nbytes
        run = self.run
        if msg.job != self.job_id or msg.epoch != self.epoch:
            return self._reject("wrong_job", msg)
        if run is None or (msg.step, msg.op) != (run.step, run.op):
            self.c.dropped += 1  # late: from a GEMM that is already complete; but the worker is alive
            if msg.worker_id in self.workers:
                self.workers[msg.worker_id].suspect = False
            return None
        if not run.ledger.was_issued(msg.tile, msg.attempt):
            return self._reject("unknown_tile", msg)
        slot = self.workers.get(msg.worker_id)
        att = run.ledger.running.get((msg.tile, msg.attempt))
        if att is not None and att.worker != msg.worker_id:
            return self._reject("wrong_worker", msg)
        if slot is not None:
            now = time.monotonic()
            if att is not None:
                rt = now - att.sent_at
                old = slot.round_trips.get(run.shape, 0.0)
                slot.round_trips[run.shape] = rt if old == 0 else 0.8 * old + 0.2 * rt
            slot.last_progress, slot.suspect = now, False
        if msg.missing:
            self.c.cache_misses += 1
            if slot is not None:
                for block_id in msg.missing:
                    slot.forget(block_id)
            run.ledger.retry(msg.tile, msg.attempt)
        elif msg.error or msg.out is None:
            self._reject("worker_error", msg, msg.error)
            run.ledger.retry(msg.tile, msg.attempt)
        else:
            await self._accept(run, msg)
        if slot is not None:
            await self._fill(slot)
        return None

    async def _accept(self, run: GemmRun, msg: TileResult) -> None:
        t = run.ledger.tiles[msg.tile]
        out = msg.out
        if tuple(out.shape) != (t.rows, t.cols) or out.dtype != str(run.out.dtype).removeprefix("torch."):
            self._reject("bad_shape", msg, f"{out.dtype}{tuple(out.shape)} for a {t.rows}x{t.cols} block")
            run.ledger.retry(msg.tile, msg.attempt)
            return
        block = np.frombuffer(out.data, dtype=np.dtype(out.dtype)).reshape(t.rows, t.cols)
        if not np.isfinite(block).all() and self._inputs_finite(run, t):
            self._reject("not_finite", msg)
            run.ledger.retry(msg.tile, msg.attempt)
            return
        check = self.verifier.checks.get(msg.tile)
        if check is not None and check.attempt == msg.attempt:
            self._settle(run, check, torch.from_numpy(block.copy()))
            return
        outcome = run.ledger.finish(msg.tile, msg.attempt)
        if outcome != "accepted":
            return
        run.out.numpy()[t.r0 : t.r1, t.c0 : t.c1] = block
        self._close_recoveries(run, msg.tile)
        if self.verifier.sample():
            await self._verify(run, msg.tile, msg.worker_id)
        self._maybe_done(run)

    def _maybe_done(self, run: GemmRun) -> None:
        if run.ledger.complete and not self.verifier.checks:
            run.done.set()

    async def _verify(self, run: GemmRun, tile: int, first: str) -> None:
        """Have another live worker compute the same tile; the comparison comes with its result."""
        others = [w for w in self._live() if w.worker_id != first]
        if not others:
            return
        slot = min(others, key=lambda w: run.ledger.count(w.worker_id))
        t = run.ledger.tiles[tile]
        att = run.ledger.issue_extra(tile, slot.worker_id, time.monotonic())
        self.verifier.checks[tile] = Check(tile, att.attempt, first, slot.worker_id,
                                           run.out[t.r0 : t.r1, t.c0 : t.c1].clone())
        await self._send(slot, run, att)

    def _settle(self, run: GemmRun, check: Check, second: torch.Tensor) -> None:
        del self.verifier.checks[check.tile]
        run.ledger.drop(check.tile, check.attempt)
        t = run.ledger.tiles[check.tile]
        truth = tiles.compute(run.a[t.r0 : t.r1], run.bt[t.c0 : t.c1])
        liar = self.verifier.judge(check, second, truth)
        if liar is not None:
            self.faulty.add(liar)
            self.workers.pop(liar, None)
            run.spoiled = liar
            log.warning("worker_faulty", worker_id=liar, step=run.step, gemm=run.name, tile=check.tile)
            self.c.recoveries.append(Event(kind="worker_faulty", at=time.time(), step=run.step, worker_id=liar,
                                           cause="verification_mismatch", detail={"gemm": run.name}))
            run.done.set()
            return
        self._maybe_done(run)

    @staticmethod
    def _inputs_finite(run: GemmRun, t: tiles.Tile) -> bool:
        return bool(torch.isfinite(run.a[t.r0 : t.r1]).all() and torch.isfinite(run.bt[t.c0 : t.c1]).all())

    def _reject(self, reason: str, msg: TileResult, detail: str = "") -> None:
        self.c.rejected += 1
        self.bus.reject(reason, f"result from {msg.worker_id}", f"step {msg.step} op {msg.op} tile {msg.tile} {detail}")

    # ---- loss of workers -----------------------------------------------------------------------------
    async def _check_progress(self) -> None:
        run, now = self.run, time.monotonic()
        if run is None:
            return
        for slot in list(self.workers.values()):
            inflight = run.ledger.inflight(slot.worker_id)
            if not inflight or slot.suspect:
                continue
            since = max(slot.last_progress, min(a.sent_at for a in inflight))
            # a planned block may legitimately take its GEMM's predicted makespan, however slow the device
            deadline = self.s.timeout_factor * max(slot.round_trips.get(run.shape, 0.0), run.expected_s)
            deadline = max(self.s.tile_timeout_s, deadline)
            if now - since > deadline:
                slot.suspect, slot.suspect_since = True, now
                self._lose(slot.worker_id, now, cause="tile_deadline", silent_since=since)
        await self._fill_all()

    def _lose(self, worker: str, now: float, cause: str, silent_since: float | None = None) -> None:
        run = self.run
        if run is None:
            return
        for tile, check in list(self.verifier.checks.items()):  # a verifier that vanished verifies nothing
            if check.verifier == worker:
                del self.verifier.checks[tile]
        if run.ledger.complete and not self.verifier.checks:
            run.done.set()
        lost = run.ledger.give_back(worker, self._chunks)
        if lost:
            log.warning("tiles_resent", worker_id=worker, cause=cause, step=run.step, gemm=run.name, tiles=len(lost))
            run.recoveries.append(Recovery(worker, cause, silent_since or now, now, set(lost)))

    def _close_recoveries(self, run: GemmRun, tile: int) -> None:
        for rec in list(run.recoveries):
            rec.tiles.discard(tile)
            if rec.tiles:
                continue
            run.recoveries.remove(rec)
            now = time.monotonic()
            self.c.recoveries.append(Event(
                kind="recovered", at=time.time(), step=run.step, worker_id=rec.worker, cause=rec.cause,
                detect_s=rec.detected_at - rec.silent_since,
                redispatch_s=(rec.redispatched_at or now) - rec.detected_at,
                complete_s=now - rec.detected_at, detail={"gemm": run.name},
            ))
