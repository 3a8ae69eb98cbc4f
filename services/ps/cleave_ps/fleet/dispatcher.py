"""The PS's NATS shell around the dealing core (`cleave.gemm.dealer.Dealer`): the GEMMs in flight (one, or
several: a layer's weight gradient is dealt beside the input gradients that follow it, `gemm(priority=)`),
their tiles turned into messages to the workers of the current plan, their results checked and assembled.

Every decision (who gets which tile, what is stolen, copied, given back, when a worker is presumed lost)
is the dealer's; this module only does I/O and the byte work, off the event loop (slicing, casting and
encoding the blocks a batch of tiles needs in one worker thread; decoding and checking each result in
another). A result names the GEMM run it belongs to (`TileResult.gemm`, monotonic within the PS epoch), so
a late or speculative result from an earlier run of the same step (a step redone after a liar was caught,
the validation pass) is dropped and counted, never assembled.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence

import structlog
import torch

from cleave import codec
from cleave.bus import Bus
from cleave.errors import StepAborted, StepSpoiled
from cleave.gemm import fanout, tiles
from cleave.gemm.dealer import (
    Dealer,
    Instruction,
    Policy,
    ProveLink,
    Recovery,
    RecoveryDone,
    Send,
    TilesLost,
    Work,
    WorkerLost,
)
from cleave.schemas import (
    SUBJECT_CONTROL,
    SUBJECT_FANOUT,
    SUBJECT_RESULTS,
    Event,
    FanoutAck,
    FanoutJoin,
    Plan,
    TileResult,
)
from cleave.train import precision
from cleave_ps.fleet import frames, linkcheck
from cleave_ps.fleet.runs import Counters, GemmRun
from cleave_ps.fleet.verify import Check, Verifier
from cleave_ps.settings import PsSettings

log = structlog.get_logger("ps")
DEFAULT_WAIT_LOG_S = 5.0
DEFAULT_JOIN_TIMEOUT_S = 2.0  # a worker that does not confirm its fan-out groups by then gets blocks direct
DEFAULT_JOIN_CONCURRENCY = 64
OFF_LOOP_BYTES = 1 << 20  # byte work on more than this runs in a worker thread


def policy_of(s: PsSettings) -> Policy:
    return Policy(window=s.window, tile_timeout_s=s.tile_timeout_s, timeout_factor=s.timeout_factor,
                  speculate_factor=s.speculate_factor, speculate_min_s=s.speculate_min_s, copy_share=s.copy_share, tick_s=s.tick_s,
                  max_inflight_bytes=s.max_inflight_bytes or None)


class Dispatcher:
    def __init__(self, bus: Bus, job_id: str, epoch: int, s: PsSettings) -> None:
        self.bus, self.job_id, self.epoch, self.s = bus, job_id, epoch, s
        self.clock = time.monotonic  # what the dealer is told the time is (a test may replay recorded times)
        self.dealer = Dealer(policy_of(s))
        self.plan: Plan | None = None
        self.runs: dict[int, GemmRun] = {}  # the GEMMs in flight, by seq
        self._busy_from = 0.0  # since when some are
        self.seq = 0  # GEMM runs of this epoch
        self.c = Counters()
        self._uids: dict[tuple, tuple[int, weakref.ref]] = {}
        self._next_uid = 0
        self.stopping = False
        self.verifier = Verifier(s.verify_fraction, seed=epoch)
        # the approximate mode: input blocks travel in half precision (results stay float32)
        self.tile_dtype = precision.DTYPES[s.tile_dtype]
        self.faulty: set[str] = set()  # workers caught returning wrong blocks: never dealt to again
        self._tasks: set[asyncio.Task] = set()
        bus.on_dropped.append(self._dropped)
        self._joining: asyncio.Task | None = None  # telling the workers their fan-out groups
        self._last_join: dict[str, list[str]] = {}  # worker -> the groups it last confirmed
        self._sent_bytes = self.tile_dtype.itemsize if self.tile_dtype else 4  # bytes per element that travel

    @property
    def workers(self) -> dict:
        return self.dealer.members

    @property
    def run(self) -> GemmRun | None:
        """The GEMM in flight when there is one (None otherwise, or with several)."""
        return next(iter(self.runs.values())) if len(self.runs) == 1 else None

    # ---- plan ----------------------------------------------------------------------------------------
    async def set_plan(self, plan: Plan) -> None:
        self.plan = plan
        fleet = [(w.worker_id, w.cache_bytes, w.profile) for w in plan.workers if w.worker_id not in self.faulty]
        dealt = self.dealer.set_fleet(fleet, self.clock())
        log.info("plan_applied", version=plan.version, workers=len(fleet), reason=plan.reason)
        await self.post(dealt)
        if self.s.fanout:
            if self._joining is not None:
                self._joining.cancel()
            self._joining = asyncio.create_task(self._join_groups(plan))

    async def _join_groups(self, plan: Plan) -> None:
        """Tell each planned worker the fan-out groups of this plan (`cleave.gemm.fanout`); only those that confirm
        are sent shared blocks that way, the others get them with their tiles."""
        cut = [self._tiling(g.m, g.n, g.k, self._sent_bytes)[:2] for g in plan.gemms]
        groups = fanout.memberships(cut, plan.chunks)
        gate = asyncio.Semaphore(DEFAULT_JOIN_CONCURRENCY)

        async def join(worker: str) -> None:
            names = sorted(groups.get(worker, ()))
            if self._last_join.get(worker) == names:
                return
            subjects = tuple(SUBJECT_FANOUT.format(job=self.job_id, epoch=self.epoch, group=g) for g in names)
            async with gate:
                try:
                    ack = await self.bus.request(SUBJECT_CONTROL.format(worker_id=worker), FanoutJoin(
                        job=self.job_id, epoch=self.epoch, version=plan.version, subjects=subjects),
                        FanoutAck, timeout_s=DEFAULT_JOIN_TIMEOUT_S)
                except Exception as e:  # an old worker, or one that is gone: blocks go with its tiles
                    log.info("fanout_not_joined", worker_id=worker, error=repr(e)[:200])
                    return
            if ack.error:
                log.warning("fanout_not_joined", worker_id=worker, error=ack.error[:200])
                return
            joined = {s.rsplit(".", 1)[1] for s in ack.joined}
            self.dealer.join(worker, joined & set(names))
            self._last_join[worker] = names

        await asyncio.gather(*(join(w) for w in list(self.dealer.members)))

    # ---- one GEMM ------------------------------------------------------------------------------------
    def new_step(self) -> None:
        self._uids.clear()  # block ids are only reused within a step

    def _uid(self, t: torch.Tensor) -> int:
        """A number for this tensor's contents: the same while the tensor lives and is unchanged (an input
        shared by several GEMMs stays in the workers' caches), never reused for other contents; held by a
        weak reference, so the PS keeps no tensor alive for it."""
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t._version, t.dtype)
        hit = self._uids.get(key)
        if hit is None or hit[1]() is None:  # new, or the tensor died and its memory may hold another
            self._next_uid += 1
            hit = self._uids[key] = (self._next_uid, weakref.ref(t))
        return hit[0]

    async def gemm(self, a: torch.Tensor, bt: torch.Tensor, step: int, op: int, name: str,
                   names: tuple[torch.Tensor, torch.Tensor] | None = None, priority: int = 0) -> torch.Tensor:
        """a · btᵀ through the fleet, dealt beside the other GEMMs in flight: workers take its tiles when
        none of a lower `priority` has one for them. `names`: the tensors whose identity names the blocks in
        the workers' caches (a CUDA PS's GPU tensors, of which `a` and `bt` are host copies); a pinned `a`
        gets a pinned product, which goes back to the GPU without blocking."""
        want = a.dtype  # a bf16/fp16 job (cleave.train.precision) sends its inputs as they come and gets them back so
        cast = self.tile_dtype if want == torch.float32 else None  # the approximate mode rounds float32 inputs
        sent = cast or want  # the bytes per element that travel
        pin = a.is_pinned()
        m, n, k = a.shape[0], bt.shape[0], a.shape[1]
        grid, owners, expected_s = self._tiling(m, n, k, sent.itemsize)
        self._sent_bytes = sent.itemsize
        self.seq += 1
        seq = self.seq
        a_key, b_key = (f"{self.epoch}.{self._uid(t)}" for t in names or (a, bt))
        if cast is not None:
            a, bt = await asyncio.to_thread(lambda: (a.to(cast), bt.to(cast)))
        if not self.runs:
            self._busy_from = self.clock()
        # the approximate mode's tiles come back in float32 (accumulated over the whole K); a bf16/fp16 job's
        # in its precision, each block rounded once by its worker as the product would be here
        rounded = "" if cast is not None or want == torch.float32 else codec.dtype_name(want)
        run = self.runs[seq] = GemmRun(seq, step, op, name, a, bt, torch.empty(m, n, dtype=want if rounded else
                                       torch.float32, pin_memory=pin), expected_s=expected_s, rounded=rounded)
        self.c.concurrent = max(self.c.concurrent, len(self.runs))
        split, shared = fanout.layout(grid, owners, a_key, b_key, self._chunks) if self.s.fanout else (None, None)
        work = Work(seq, m, n, k, sent.itemsize, grid, owners, self._chunks, a_key, b_key, shared, split)
        started = waited = self.clock()
        try:
            await self.post(self.dealer.begin(work, started, priority))
            # done: every tile's block is in `out` (`_maybe_done`, after its copy); the ledger alone says
            # complete while the last block may still be on its way into `out` in a thread
            while run.spoiled or not run.done.is_set():
                if self.stopping:
                    raise StepAborted("the parameter server is stopping")
                if run.spoiled:
                    raise StepSpoiled(f"worker {run.spoiled} returned a wrong block; step {step} is redone")
                try:
                    await asyncio.wait_for(run.done.wait(), self.s.tick_s)
                except TimeoutError:
                    await self._tick()
                    if not self._live() and self.clock() - waited > DEFAULT_WAIT_LOG_S:
                        waited = self.clock()
                        led = self.dealer.deal(seq).ledger
                        log.warning("waiting_for_workers", step=step, gemm=name,
                                    pending=len(led.tiles) - len(led.done) - len(led.retired))
        finally:
            led = self.dealer.deal(seq).ledger
            self.dealer.end(seq)
            del self.runs[seq]
            if not self.runs:
                self.c.gemm_s += self.clock() - self._busy_from
        wall = self.clock() - started
        log.debug("gemm_done", step=step, gemm=name, m=m, n=n, k=k, tiles=len(grid), wall_s=round(wall, 4),
                  planned_s=round(expected_s, 4), resent=led.resent, copied=led.copied,
                  bytes_down=run.bytes_down, distinct=(m + n) * k * sent.itemsize)
        c = self.c
        c.planned_gemm_s += expected_s
        c.unplanned += owners is None
        c.tiles += len(grid)
        c.resent += led.resent
        c.copied += led.copied
        c.dropped += led.duplicates
        return run.out.to(want)

    def _tiling(self, m: int, n: int, k: int, b: int) -> tuple[list[tiles.Tile], list[str | None] | None, float]:
        """The plan's blocks for this shape, cut as `tiles.cut_planned` says, and the planned makespan; else a
        uniform grid (and 0: nothing predicted)."""
        plan = self.plan
        layout = next((g for g in plan.gemms if (g.m, g.n, g.k) == (m, n, k)), None) if plan else None
        if layout is None:
            rows, cols = tiles.uniform_block(m, n, (plan.tile_rows, plan.tile_cols) if plan else None, len(self._live()))
            return tiles.grid(m, n, rows, cols), None, 0.0
        boxes, owners = [], []
        members = self.dealer.members
        flat = layout.boxes
        for i, owner in enumerate(layout.owners):
            box = tuple(flat[4 * i : 4 * i + 4])
            cache = members[owner].cache_bytes if owner in members else 0
            parts = tiles.cut_planned(box, k, b, plan.tile_rows, plan.tile_cols, plan.chunks, cache)
            boxes += parts
            owners += [owner if owner in members else None] * len(parts)
        return tiles.from_boxes(boxes), owners, layout.makespan_s

    @property
    def _chunks(self) -> int:
        """The plan's pieces per block (1 without a plan)."""
        return self.plan.chunks if self.plan else 1

    def _live(self) -> list[str]:
        return [w for w, m in self.dealer.members.items() if not m.suspect and m.proven]

    async def _tick(self) -> None:
        await self.post(self.dealer.tick(self.clock()))

    # ---- what the dealer decided ---------------------------------------------------------------------
    def _note(self, i: Instruction) -> None:
        """An instruction that is not a send: a link to prove (tiles only once its downlink answers), a
        worker lost (a verification it owed will not come), tiles lost (logged once), a loss made good
        (a recovery event in the step's metrics)."""
        if isinstance(i, ProveLink):
            self._track(linkcheck.prove(self, i.worker))
        elif isinstance(i, WorkerLost):
            self._forget_checks(i.worker)
        elif isinstance(i, TilesLost):
            run, rec = self.runs.get(i.recovery.seq), i.recovery
            log.warning("tiles_resent", worker_id=rec.worker, cause=rec.cause, step=run.step if run else None,
                        gemm=run.name if run else None, tiles=rec.count)
        elif isinstance(i, RecoveryDone):
            self.c.recoveries.append(self._event(i.recovery, self.runs.get(i.recovery.seq)))

    # ---- sending -------------------------------------------------------------------------------------
    async def post(self, instructions: Sequence[Instruction]) -> None:
        """Carry out what the dealer decided, in its order: what is not a send at once (`_note`), then the
        tiles, encoded in a worker thread and published in order (those of a GEMM that is over are not sent)."""
        sends = []
        for i in instructions:
            if isinstance(i, Send):
                sends.append(i)
            else:
                self._note(i)
        dealt = [(s, self.runs[s.seq]) for s in sends if s.seq in self.runs]  # (looked up here: a GEMM may end
        if not dealt:  # on the loop while the thread encodes)
            return
        encoded = await asyncio.to_thread(self._frames, dealt)
        for worker, subject, frame, send, run in encoded:
            try:
                sent = await self.bus.publish_frame(subject, frame)
                self.c.bytes_down += sent
                run.bytes_down += sent
            except Exception as e:  # disconnected: the deadline check will hand the tile to someone else
                log.warning("tile_not_sent", worker_id=worker, error=repr(e))
            if send is not None and send.seq in self.runs:  # its clock starts when it leaves, not when dealt
                self.dealer.departed(send.tile.index, send.attempt, self.clock(), send.seq)

    def _frames(self, dealt: list[tuple[Send, GemmRun]]) -> list[tuple[str, str, bytes, Send | None, GemmRun]]:
        """(worker, subject, encoded message, send, its GEMM) for each send (runs off the event loop)."""
        return [(*frame, run) for s, run in dealt
                for frame in frames.encode(self.job_id, self.epoch, run, s, self.reply_to(s.worker))]

    def reply_to(self, worker: str) -> str:
        return SUBJECT_RESULTS.format(job=self.job_id, epoch=self.epoch, worker_id=worker)

    # ---- results -------------------------------------------------------------------------------------
    async def on_result(self, msg: TileResult, nbytes: int) -> None:
        self.c.bytes_up += nbytes
        if msg.job != self.job_id or msg.epoch != self.epoch:
            return self._reject("wrong_job", msg)
        run = self.runs.get(msg.gemm)
        if run is None or (msg.step, msg.op) != (run.step, run.op):
            self.c.dropped += 1  # late: from a GEMM run that is over; but the worker is alive
            self.c.fenced += any((msg.step, msg.op) == (r.step, r.op) for r in self.runs.values())
            self.dealer.heard(msg.worker_id)
            return None
        seq, led = run.seq, self.dealer.deal(run.seq).ledger
        if not led.was_issued(msg.tile, msg.attempt):
            return self._reject("unknown_tile", msg)
        att = self.dealer.running(msg.worker_id, msg.tile, msg.attempt, seq)
        if att is not None and att.worker != msg.worker_id:
            return self._reject("wrong_worker", msg)
        now = self.clock()
        if msg.missing:
            self.c.cache_misses += 1
            sends = self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, now, msg.missing, seq)
        elif msg.error or msg.out is None:
            self._reject("worker_error", msg, msg.error)
            sends = self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, now, seq=seq)
        else:
            sends = await self._accept(run, msg)
        await self.post(sends)
        return None

    async def _accept(self, run: GemmRun, msg: TileResult) -> list[Instruction]:
        seq = run.seq
        t = self.dealer.deal(seq).ledger.tiles[msg.tile]
        out = msg.out
        if tuple(out.shape) != (t.rows, t.cols) or out.dtype != codec.dtype_name(run.out.dtype):
            self._reject("bad_shape", msg, f"{out.dtype}{tuple(out.shape)} for a {t.rows}x{t.cols} block")
            return self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, self.clock(), seq=seq)
        block = frames.block(out, t.rows, t.cols)
        if not await self._off_loop(block.nbytes, lambda: frames.finite(block, out.dtype) or not self._inputs_finite(run, t)):
            self._reject("not_finite", msg)
            return self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, self.clock(), seq=seq)
        if seq not in self.runs:  # it ended while the block was checked (a step aborted)
            return []
        now = self.clock()
        check = run.checks.get(msg.tile)
        if check is not None and check.attempt == msg.attempt:
            sends = self.dealer.discard(msg.worker_id, msg.tile, msg.attempt, now, seq)
            await self._settle(run, check, torch.from_numpy(block.copy()).view(run.out.dtype))
            return sends
        outcome, sends = self.dealer.done(msg.worker_id, msg.tile, msg.attempt, now, seq)
        if outcome != "accepted":
            return sends
        target = run.out.view(torch.int16) if run.out.dtype == torch.bfloat16 else run.out  # numpy has no bfloat16
        await self._off_loop(block.nbytes, lambda: target.numpy().__setitem__((slice(t.r0, t.r1), slice(t.c0, t.c1)), block))
        if self.verifier.sample():
            sends += self._verify(run, msg.tile, msg.worker_id)
        self._maybe_done(run)
        return sends

    @staticmethod
    async def _off_loop(nbytes: int, fn):  # noqa: ANN001, ANN205
        """`fn()` in a worker thread when it touches many bytes, else right here (a thread hop costs more)."""
        return await asyncio.to_thread(fn) if nbytes > OFF_LOOP_BYTES else fn()

    def _maybe_done(self, run: GemmRun) -> None:
        if self.dealer.is_complete(run.seq) and not run.checks:
            run.done.set()

    def _verify(self, run: GemmRun, tile: int, first: str) -> list[Send]:
        """Have another live worker compute the same tile; the comparison comes with its result."""
        others = [w for w in self._live() if w != first]
        if not others:
            return []
        led = self.dealer.deal(run.seq).ledger
        worker = min(others, key=led.count)
        t = led.tiles[tile]
        send = self.dealer.extra(tile, worker, self.clock(), run.seq)
        run.checks[tile] = Check(tile, send.attempt, first, worker, run.out[t.r0 : t.r1, t.c0 : t.c1].clone())
        return [send]

    async def _settle(self, run: GemmRun, check: Check, second: torch.Tensor) -> None:
        del run.checks[check.tile]
        if run.seq not in self.runs:
            return
        t = self.dealer.deal(run.seq).ledger.tiles[check.tile]
        if self.verifier.agree(check.block, second):  # no need for the PS's own product
            self.verifier.done += 1
            self._maybe_done(run)
            return
        truth = await asyncio.to_thread(lambda: tiles.compute(run.a[t.r0 : t.r1].float(), run.bt[t.c0 : t.c1].float())
                                        .to(run.out.dtype))
        liar = self.verifier.judge(check, second, truth)
        if liar is not None:
            self.faulty.add(liar)
            for i in self.dealer.remove(liar, self.clock(), "verification_mismatch"):  # no sends: losses
                self._note(i)
            for other in self.runs.values():  # its blocks may be in any GEMM in flight: the step is redone
                other.spoiled = liar
                other.done.set()
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
    def _dropped(self, subject: str) -> None:
        """The bus dropped a message unread (a slow consumer): if it was a result, deal the sender's tiles
        again now rather than at their deadline (results name their sender in the subject; without a name,
        every worker's)."""
        prefix = SUBJECT_RESULTS.split("{", 1)[0]
        if not self.runs or not subject.startswith(prefix):
            return
        tokens = subject[len(prefix):].split(".")  # job, epoch, worker
        workers = tokens[2:3] if len(tokens) > 2 else list(self.dealer.members)
        log.warning("results_dropped", subject=subject, workers=len(workers))
        self._track(self.post([i for w in workers for i in self.dealer.redo(w, self.clock())]))

    def _track(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget_checks(self, worker: str) -> None:
        """A verifier that vanished verifies nothing."""
        for run in list(self.runs.values()):
            for tile, check in list(run.checks.items()):
                if check.verifier == worker:
                    del run.checks[tile]
            self._maybe_done(run)

    @staticmethod
    def _event(rec: Recovery, run: GemmRun | None) -> Event:
        return Event(
            kind="recovered", at=time.time(), step=run.step if run else None, worker_id=rec.worker, cause=rec.cause,
            detect_s=rec.detected_at - rec.silent_since,
            redispatch_s=(rec.redispatched_at or rec.done_at) - rec.detected_at,
            complete_s=rec.done_at - rec.detected_at, detail={"gemm": run.name if run else ""},
        )
