"""The PS's side of split learning: it runs every block after the cut, the head and the loss.

One worker of the plan becomes the client for the whole job (it holds the embedding, the first k blocks,
their optimizer and the data: the job's, or its own with `own_data`; the job's tokenizer is published for it). Each step: ask the client for the activations at the cut, run the server
half, send back the gradient at the cut, and apply the server's AdamW with the clip coefficient the client
computed from the global gradient norm, exactly as one process would. With `val_every`, the client then
sends the cut of the validation batches and the PS reports the whole model's validation loss.

The server half and its AdamW are committed every `persist_every` steps (`cleave_ps.state.persist`); a restarted
PS resumes at the first step not committed, and the client (which keeps the state from before its last step)
goes back one step if it had already applied that one.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from cleave import codec
from cleave.bus import Bus
from cleave.errors import ClientLost, StepAborted
from cleave.methods import split
from cleave.methods.common import make_adamw
from cleave.models import build_model, bundles
from cleave.runtime.faults import Faults
from cleave.schemas import (
    PLAN_KEY,
    SUBJECT_SPLIT,
    SUBJECT_UPDATES,
    Plan,
    SplitReply,
    SplitTask,
    StepMetrics,
)
from cleave.train.job import JobConfig
from cleave.train.schedule import set_lr
from cleave_ps.fleet.idle import NOTICE_S, WaitNotice
from cleave_ps.fleet.plans import PlanWatch, first_of
from cleave_ps.jobs.lifecycle import Listen
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Progress

log = structlog.get_logger("ps")



class SplitJob:
    """The split-learning driver of a job's lifecycle (`lifecycle.Driver`): the server half runs here, the
    client half on one worker of the plan, chosen at the first step."""

    plan_key = PLAN_KEY

    def __init__(self, s: PsSettings, job: JobConfig, bus: Bus, stop: asyncio.Event) -> None:
        self.s, self.job, self.bus, self.stop = s, job, bus, stop
        self.idle = WaitNotice(bus, job.job_id, NOTICE_S)  # no worker in the plan yet
        self.faults = Faults(s.fail_at, s.fault_dir, tag="ps")
        self.progress = Progress(bus, job, s, self.faults)
        self.epoch = 0  # claimed before `build`
        self.reply = ""
        self.first = 0
        self.client = ""
        self.passed: set[str] = set()  # workers that could not start the job as its client (at step 0)
        self.tokenizer = ""  # the job's tokenizer, published for the client (cleave.models.bundles)
        self.shelf = bundles.Shelf()  # ... and served to it from this PS's disk
        self.waiting: dict[tuple[int, str], asyncio.Future] = {}
        self.bytes_down = self.bytes_up = 0

    def _build(self) -> None:
        _, half = split.split_model(build_model(self.job.arch(), seed=self.job.seed), self.job.split_layers)
        self.server = split.SplitServer(half, make_adamw(split.server_params(half), self.job))

    async def join(self) -> None:
        """Nothing to agree on before the epoch."""

    async def build(self, epoch: int, plans: PlanWatch) -> None:
        """The server half and its AdamW, for this epoch, and the job's tokenizer published for the client."""
        self.epoch, self.plan = epoch, plans
        self.reply = SUBJECT_UPDATES.format(job=self.job.job_id, epoch=epoch, worker_id="*")  # subscribed
        await asyncio.to_thread(self._build)
        files = (await asyncio.to_thread(bundles.job_files, None, self.job.tokenizer)).get("tokenizer")
        self.tokenizer = await self.shelf.publish(self.bus, "tokenizer", files) if files else ""

    async def resume(self) -> int:
        """Restore the last committed step; the first step to run."""
        self.first = await self.progress.resume(self.server.half, self.server.opt)
        return self.first

    def listens(self, epoch: int) -> list[Listen]:
        return [Listen(self.reply, SplitReply, self.on_reply, dict(max_bytes=self.s.max_result_bytes,
                                                                   sender="worker_id"))]

    async def on_plan(self, plan: Plan) -> None:
        """The client may have left: `ask` sees it in the plan's workers."""

    async def on_reply(self, msg: SplitReply, nbytes: int) -> None:
        self.bytes_up += nbytes
        fut = self.waiting.get((msg.step, msg.phase))
        if msg.worker_id != self.client or fut is None or fut.done():
            self.bus.reject("unexpected_split_reply", f"split reply from {msg.worker_id}", f"step {msg.step}")
            return
        fut.set_result(msg)

    async def ask(self, task: SplitTask) -> SplitReply:
        fut = self.waiting[(task.step, task.phase)] = asyncio.get_running_loop().create_future()
        self.bytes_down += await self.bus.publish(SUBJECT_SPLIT.format(worker_id=self.client), task)
        deadline = time.monotonic() + self.job.round_timeout_s
        try:
            while not fut.done():
                self.plan.changed.clear()
                if self.client not in self.plan.workers:
                    raise ClientLost(f"split-learning client {self.client} left at step {task.step}: the client "
                                     "half of the model lived only there; start the job again")
                if self.stop.is_set():
                    raise StepAborted("the parameter server is stopping")
                if time.monotonic() > deadline:
                    raise ClientLost(f"client {self.client} did not answer step {task.step} ({task.phase})")
                await first_of(fut, self.plan.changed, self.stop, timeout_s=max(0.0, deadline - time.monotonic()))
        finally:
            self.waiting.pop((task.step, task.phase), None)
        reply = fut.result()
        if reply.error:
            raise ClientLost(f"client {self.client} failed step {task.step}: {reply.error}")
        return reply

    async def val_loss(self, base: dict) -> float:
        """The whole model's validation loss after this step: the client sends the cut of the validation
        batches (`Trainer.val_loss`'s), the server half finishes the forward."""
        ev = await self.ask(SplitTask(**{**base, "phase": "eval"}))
        if ev.activations is None or ev.targets is None:
            raise ClientLost(f"client {self.client} sent no validation activations for step {base['step']}")
        tied = None if ev.tied_weight is None else codec.data_to_tensor(ev.tied_weight)
        cut = split.CutForward(codec.data_to_tensor(ev.activations), tied)
        return await asyncio.to_thread(self.server.evaluate, cut, codec.data_to_tensor(ev.targets))

    async def step(self, s: int) -> StepMetrics | None:
        if not self.client:  # the first step: the client is a worker of the plan (the same one on every PS)
            workers = await self.plan.some_workers(self.stop, lambda: self.idle.waiting(s))
            if not workers:
                return None  # stopped before any worker came
            self.client = min(set(workers) - self.passed, default="")
            if not self.client:
                raise ClientLost(f"no worker of the plan can be the client: {', '.join(sorted(self.passed))} could "
                                 "not start the job (their logs say why)")
            log.info("ps_started", job=self.job.job_id, method="split", client=self.client, steps=self.job.steps,
                     first=self.first)
        t0 = time.perf_counter()
        base = dict(job=self.job.job_id, epoch=self.epoch, step=s, job_config=self.job.model_dump_json(),
                    split_layers=self.job.split_layers, tokenizer_bundle=self.tokenizer,
                    reply=SUBJECT_UPDATES.format(job=self.job.job_id, epoch=self.epoch, worker_id=self.client))
        try:
            fwd = await self.ask(SplitTask(**base, phase="forward"))
        except ClientLost as e:  # a client that holds nothing yet (step 0) is replaced by another worker
            if s or not set(self.plan.workers) - self.passed - {self.client}:
                raise
            log.warning("split_client_passed_over", client=self.client, reason=str(e)[:300])
            self.passed.add(self.client)
            self.client = ""
            return await self.step(s)
        if fwd.activations is None or fwd.targets is None:
            raise ClientLost(f"client {self.client} sent no activations for step {s}")
        tied = None if fwd.tied_weight is None else codec.data_to_tensor(fwd.tied_weight)
        cut = split.CutForward(codec.data_to_tensor(fwd.activations), tied)
        lr = set_lr(self.server.opt, self.job, s)
        try:
            back = await asyncio.to_thread(self.server.step, cut, codec.data_to_tensor(fwd.targets))
        except FloatingPointError as e:  # the same step again (a restarted PS) would only diverge again
            raise StepAborted(f"split learning diverged at step {s}: {e}; a lower learning rate (--lr) may "
                              "help") from None
        self.faults.hit("in_step", s)
        bwd = await self.ask(SplitTask(
            **base, phase="backward", grad=codec.tensor_to_data(back.grad), loss=back.loss,
            tied_grad=None if back.tied_grad is None else codec.tensor_to_data(back.tied_grad),
            grad_sq_norm=back.grad_sq_norm,
        ))
        await asyncio.to_thread(self.server.apply, bwd.clip_coef)
        val = await self.val_loss(base) if self.job.val_every and (s + 1) % self.job.val_every == 0 else None
        m = StepMetrics(job=self.job.job_id, method="split", step=s, loss=back.loss, val_loss=val,
                        step_time_s=time.perf_counter() - t0, workers=1, bytes_down=self.bytes_down,
                        bytes_up=self.bytes_up, tokens=self.job.batch_size * self.job.seq, lr=lr,
                        resumed=self.first > 0, at=time.time())
        self.bytes_down = self.bytes_up = 0
        log.info("step_done", step=s, loss=round(m.loss, 5), step_time_s=round(m.step_time_s, 3))
        return m

    async def commit(self, m: StepMetrics) -> None:
        await self.progress.done(m, self.server.half, self.server.opt)

    async def finish(self, first: int) -> None:
        await self.progress.finish(first)

    def stopping(self) -> None:
        """A step in flight sees the stop itself (`ask` waits on it) and applies nothing."""

    def close(self) -> None:
        """Nothing is held outside this process."""
