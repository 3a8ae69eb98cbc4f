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
    RecoveryDone,
    Send,
    TilesLost,
    Work,
    WorkerLost,
)
from cleave.schemas import SUBJECT_OBSERVED, SUBJECT_RESULTS, Event, Observed, Plan, TileResult
from cleave.train import precision
from cleave_ps.fleet import frames, freivalds, joins, linkcheck, prefault
from cleave_ps.fleet.examine import examine, prepare
from cleave_ps.fleet.idle import NOTICE_S, WaitNotice
from cleave_ps.fleet.observe import Throughput
from cleave_ps.fleet.products import Products
from cleave_ps.fleet.runs import Check, Counters, GemmRun, recovery_event
from cleave_ps.fleet.verify import CrossChecks
from cleave_ps.settings import PsSettings

log = structlog.get_logger("ps")
OFF_LOOP_BYTES = 1 << 20  # byte work on more than this runs in a worker thread
RESULT_ENVELOPE = 64 * 1024  # a result's bytes besides its block (ids, an error text); its limit: + the largest block


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
        self.checks = CrossChecks(self, s.verify_fraction)  # the optional cross-worker check
        self.throughput = Throughput(self.clock())  # what each worker delivers, reported to the scheduler
        self.block_cap = 0  # bytes of the largest result block any tile of this epoch can have
        self.tile_dtype = precision.DTYPES[s.tile_dtype]  # the approximate mode: inputs travel in half precision
        self.products = Products(s.product_pool_bytes)  # the outputs' memory, reused
        self.faulty: set[str] = set()  # workers caught returning wrong blocks: never dealt to again
        self.idle = WaitNotice(bus, job_id, NOTICE_S + s.tick_s)  # none of them left to deal to
        self._tasks: set[asyncio.Task] = set()
        bus.on_dropped.append(self._dropped)
        self._joining: asyncio.Task | None = None  # telling the workers their fan-out groups
        self._last_join: dict[str, list[str]] = {}  # worker -> the groups it last confirmed
        self._sent_bytes = self.tile_dtype.itemsize if self.tile_dtype else 4  # bytes per element that travel
        if s.freivalds:
            freivalds.one_blas_thread()

    @property
    def workers(self) -> dict:
        return self.dealer.members

    @property
    def verifier(self):  # noqa: ANN201
        return self.checks.verifier

    def result_limit(self) -> int:
        """The largest result a worker can rightly send now (the bus refuses larger ones before decoding)."""
        return min(self.s.max_result_bytes, self.block_cap + RESULT_ENVELOPE)

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
            self._joining = asyncio.create_task(joins.join_groups(self, plan))

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
        # (the job too: every job's PS numbers its tensors from 1 in its first epoch, and workers outlive jobs)
        a_key, b_key = (f"{self.job_id}.{self.epoch}.{self._uid(t)}" for t in names or (a, bt))
        if cast is not None:
            a, bt = await asyncio.to_thread(lambda: (a.to(cast), bt.to(cast)))
        if not self.runs:
            self._busy_from = self.clock()
        # the approximate mode's tiles come back in float32 (accumulated over the whole K); a bf16/fp16 job's
        # in its precision, each block rounded once by its worker as the product would be here
        rounded = "" if cast is not None or want == torch.float32 else codec.dtype_name(want)
        out, fresh = self.products.take(m, n, want if rounded else torch.float32, pin)
        run = self.runs[seq] = GemmRun(seq, step, op, name, a, bt, out, expected_s=expected_s, rounded=rounded,
                                       strips=tuple(sorted({(t.c0, t.c1) for t in grid})) if self.s.freivalds else ())
        if fresh and prefault.wanted(out):  # its pages present before its blocks arrive, off the loop
            self.track(asyncio.to_thread(prefault.prefault, run.out))
        self.c.concurrent = max(self.c.concurrent, len(self.runs))
        itemsize = run.out.element_size()
        self.block_cap = max(self.block_cap, max((t.rows * t.cols * itemsize for t in grid), default=0))
        split, shared = fanout.layout(grid, owners, a_key, b_key, self._chunks) if self.s.fanout else (None, None)
        work = Work(seq, m, n, k, sent.itemsize, grid, owners, self._chunks, a_key, b_key, shared, split)
        started = waited = self.clock()
        try:
            await self.post(self.dealer.begin(work, started, priority))
            if self.s.freivalds:  # what all its checks share, off the loop while the workers compute
                self.track(self._prepare(run))
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
                    if not self.live() and self.clock() - waited > NOTICE_S:
                        waited, led = self.clock(), self.dealer.deal(seq).ledger
                        self.track(self.idle.waiting(step, len(self.faulty), gemm=name, pending=len(led.tiles)
                                                     - len(led.done) - len(led.retired)))
        finally:
            led = self.dealer.deal(seq).ledger
            self.dealer.end(seq)
            del self.runs[seq]
            if not self.runs:
                self.c.gemm_s += self.clock() - self._busy_from
            self.throughput.unanswered(seq, self.clock())
            self._observed()
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
        uniform grid for the plan's workers, answering yet or not, as the simulator cuts it (and 0: nothing
        predicted): BLAS may round a block of another shape differently (`benchmarks/blas_shapes.py`)."""
        plan = self.plan
        layout = next((g for g in plan.gemms if (g.m, g.n, g.k) == (m, n, k)), None) if plan else None
        if layout is None:
            rows, cols = tiles.uniform_block(m, n, (plan.tile_rows, plan.tile_cols) if plan else None,
                                             len(self.dealer.members))
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

    def live(self) -> list[str]:
        return [w for w, m in self.dealer.members.items() if not m.suspect and m.proven]

    async def _tick(self) -> None:
        await self.post(self.dealer.tick(self.clock()))

    # ---- what the dealer decided ---------------------------------------------------------------------
    def _note(self, i: Instruction) -> None:
        """An instruction that is not a send: a link to prove (tiles only once its downlink answers), a
        worker lost (a verification it owed will not come), tiles lost (logged once), a loss made good
        (a recovery event in the step's metrics)."""
        if isinstance(i, ProveLink):
            self.track(linkcheck.prove(self, i.worker))
        elif isinstance(i, WorkerLost):
            self.checks.vanished(i.worker)  # a verification it owed is judged by the PS
        elif isinstance(i, TilesLost):
            run, rec = self.runs.get(i.recovery.seq), i.recovery
            log.warning("tiles_resent", worker_id=rec.worker, cause=rec.cause, step=run.step if run else None,
                        gemm=run.name if run else None, tiles=rec.count)
        elif isinstance(i, RecoveryDone):
            self.c.recoveries.append(recovery_event(i.recovery, self.runs.get(i.recovery.seq)))

    # ---- sending -------------------------------------------------------------------------------------
    async def post(self, instructions: Sequence[Instruction]) -> None:
        """Carry out what the dealer decided, in its order: what is not a send at once (`_note`), then the
        tiles, encoded (in a thread where that copies over OFF_LOOP_BYTES or a tile carries more: 4 MiB tiles sent
        after the hop cost the PS less CPU in ps_rate.py, 200 KB ones are faster without) and published in order."""
        sends = []
        for i in instructions:
            if isinstance(i, Send):
                sends.append(i)
            else:
                self._note(i)
        dealt = [(s, self.runs[s.seq]) for s in sends if s.seq in self.runs]  # (looked up here: a GEMM may end
        if not dealt:  # on the loop while the thread encodes)
            return
        work = max(frames.copied({s.seq: r for s, r in dealt}.values()), *(s.nbytes + s.pushed for s, _ in dealt))
        encoded = await self._off_loop(work, lambda: self._frames(dealt))
        for worker, subject, frame, _, run in encoded:  # written, then sent together (their blocks stay as they are)
            try:
                sent = await self.bus.publish_pieces(subject, frame, wait=False)
                self.c.bytes_down += sent
                run.bytes_down += sent
            except Exception as e:  # disconnected: the deadline check will hand the tile to someone else
                log.warning("tile_not_sent", worker_id=worker, error=repr(e))
        try:
            await self.bus.settled()
        except Exception as e:
            log.warning("tiles_not_sent", tiles=len(encoded), error=repr(e))
        for *_, send, _ in encoded:
            if send is not None and send.seq in self.runs:  # its clock starts when it leaves, not when dealt
                self.dealer.departed(send.tile.index, send.attempt, self.clock(), send.seq)

    def _frames(self, dealt: list[tuple[Send, GemmRun]]) -> list[tuple[str, str, list[codec.Piece], Send | None, GemmRun]]:
        """(worker, subject, encoded message, send, its GEMM) for each send."""
        return [(*frame, run) for s, run in dealt
                for frame in frames.encode(self.job_id, self.epoch, run, s, self.reply_to(s.worker))]

    def reply_to(self, worker: str) -> str:
        return SUBJECT_RESULTS.format(job=self.job_id, epoch=self.epoch, worker_id=worker)

    # ---- results -------------------------------------------------------------------------------------
    async def on_result(self, msg: TileResult, nbytes: int) -> None:
        self.c.bytes_up += nbytes
        if msg.job != self.job_id or msg.epoch != self.epoch:
            return self._reject("wrong_job", msg)
        if msg.worker_id in self.faulty:
            return self._reject("faulty", msg)
        if msg.worker_id not in self.dealer.members:
            return self._reject("not_member", msg)
        run = self.runs.get(msg.gemm)
        if run is None or (msg.step, msg.op) != (run.step, run.op):
            self.c.dropped += 1  # late: from a GEMM run that is over; but the worker is alive
            self.c.fenced += any((msg.step, msg.op) == (r.step, r.op) for r in self.runs.values())
            self.dealer.heard(msg.worker_id)
            return None
        seq, led = run.seq, self.dealer.deal(run.seq).ledger
        holder = led.issued_to(msg.tile, msg.attempt)  # remembered for the whole run, given back or not
        if holder is None:
            return self._reject("unknown_tile", msg)
        if holder != msg.worker_id:
            return self._reject("wrong_worker", msg, f"issued to {holder}")
        check = run.checks.get(msg.tile)
        check = check if check is not None and check.attempt == msg.attempt else None
        now = self.clock()
        if msg.missing:
            self.c.cache_misses += 1
            sends = self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, now, msg.missing, seq)
        elif msg.error or msg.out is None:
            self._reject("worker_error", msg, msg.error)
            sends = self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, now, seq=seq)
        else:
            return await self.post(await self._accept(run, msg, check))
        if check is not None:  # the verifier will not deliver: the PS judges the check itself
            self.track(self.checks.settle(run, check, None))
        await self.post(sends)
        return None

    async def _accept(self, run: GemmRun, msg: TileResult, check: Check | None) -> list[Instruction]:
        seq = run.seq
        t = self.dealer.deal(seq).ledger.tiles[msg.tile]
        out = msg.out
        why, worst = "", 0.0
        if tuple(out.shape) != (t.rows, t.cols) or out.dtype != codec.dtype_name(run.out.dtype):
            why = "bad_shape"
            self._reject(why, msg, f"{out.dtype}{tuple(out.shape)} for a {t.rows}x{t.cols} block")
        else:
            block = frames.block(out, t.rows, t.cols)
            touched = block.nbytes + (t.rows + t.cols) * run.a.shape[1] * run.a.element_size()
            if not run.norms.is_ready:  # (not yet: this check computes it or waits for it, off the loop)
                touched += (run.a.numel() + run.bt.numel()) * run.a.element_size()
            why, worst, cpu = await self._off_loop(touched, lambda: examine(run, t, block, out.dtype, self.s.freivalds))
            self.c.verify_cpu_s += cpu
            self.c.verified += not why and self.s.freivalds
        if seq not in self.runs:  # it ended while the block was checked (a step aborted)
            return []
        if why:
            if check is not None:
                self.track(self.checks.settle(run, check, None))
            if why == "wrong_block":  # not the product of its inputs: a faulty or lying worker
                self._reject(why, msg, f"residual {worst:.3g} x the rounding tolerance")
                self.expel(msg.worker_id, run, msg.tile, "freivalds", spoil=False)
                return []
            if why == "not_finite":
                self._reject(why, msg)
            return self.dealer.failed(msg.worker_id, msg.tile, msg.attempt, self.clock(), seq=seq)
        now = self.clock()
        if check is not None:
            sends = self.dealer.discard(msg.worker_id, msg.tile, msg.attempt, now, seq)
            await self.checks.settle(run, check, torch.from_numpy(block.copy()).view(run.out.dtype))
            return sends
        racing = self.dealer.racing(msg.tile, seq)  # its own attempt, and those it beats (copies, originals)
        att = next((a for a in racing if a.attempt == msg.attempt), None)
        others = [a for a in racing if a.attempt != msg.attempt]
        outcome, sends = self.dealer.done(msg.worker_id, msg.tile, msg.attempt, now, seq)
        if outcome == "duplicate":  # a beaten attempt's own block: what its worker delivers
            self.throughput.late((seq, msg.tile, msg.attempt), msg.worker_id, now)
        if outcome != "accepted":
            return sends
        work = self.dealer.deal(seq).work
        for a in (att, *others):
            m = self.dealer.members.get(a.worker) if a is not None else None
            if m is None or m.profile is None:
                continue
            predicted = m.predicted_s(t, work.k, work.b)
            if a is att:
                self.throughput.accepted(a.worker, a.sent_at, now, predicted, m.profile.flops)
            else:
                self.throughput.beaten((seq, msg.tile, a.attempt), a.worker, a.sent_at, predicted, m.profile.flops)
        target = run.out.view(torch.int16) if run.out.dtype == torch.bfloat16 else run.out  # numpy has no bfloat16
        await self._off_loop(block.nbytes, lambda: target.numpy().__setitem__((slice(t.r0, t.r1), slice(t.c0, t.c1)), block))
        sends += self.checks.maybe(run, msg.tile, msg.worker_id)
        self.maybe_done(run)
        return sends

    async def _prepare(self, run: GemmRun) -> None:
        self.c.verify_cpu_s += await asyncio.to_thread(prepare, run)

    @staticmethod
    async def _off_loop(nbytes: int, fn):  # noqa: ANN001, ANN205
        """`fn()` in a worker thread when it touches many bytes, else right here (a thread hop costs more)."""
        return await asyncio.to_thread(fn) if nbytes > OFF_LOOP_BYTES else fn()

    def maybe_done(self, run: GemmRun) -> None:
        if self.dealer.is_complete(run.seq) and not run.checks:
            run.done.set()

    def expel(self, worker: str, run: GemmRun, tile: int, cause: str, spoil: bool) -> None:
        """`worker` returned a wrong block: it is never dealt to again, its tiles go to others, and with `spoil`
        every GEMM in flight is redone without it (its blocks there may be wrong too)."""
        if worker in self.faulty:
            return
        self.faulty.add(worker)
        self.throughput.forget(worker)
        for i in self.dealer.remove(worker, self.clock(), cause):  # no sends: losses
            self._note(i)
        if spoil:
            for other in self.runs.values():
                other.spoiled = worker
                other.done.set()
        log.warning("worker_faulty", worker_id=worker, step=run.step, gemm=run.name, tile=tile, cause=cause)
        self.c.recoveries.append(Event(kind="worker_faulty", at=time.time(), step=run.step, worker_id=worker,
                                       cause=cause, detail={"gemm": run.name}))

    def _reject(self, reason: str, msg: TileResult, detail: str = "") -> None:
        self.c.rejected += 1
        self.bus.reject(reason, f"result from {msg.worker_id}", f"step {msg.step} op {msg.op} tile {msg.tile} {detail}")

    def _observed(self) -> None:
        """Tell the scheduler what the workers delivered, when there is something new to tell."""
        report = self.throughput.report(self.job_id, self.clock(), time.time())
        if report is not None:
            self.track(self._publish_observed(report))

    async def _publish_observed(self, report: Observed) -> None:
        try:
            await self.bus.publish(SUBJECT_OBSERVED.format(job=self.job_id), report, compress=False)
        except Exception as e:  # NATS down: the next report says it again
            log.info("observed_not_sent", error=repr(e)[:200])

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
        self.track(self.post([i for w in workers for i in self.dealer.redo(w, self.clock())]))

    def track(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
