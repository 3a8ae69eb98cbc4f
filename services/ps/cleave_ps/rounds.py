"""The PS's side of the data-parallel methods (diloco, fedavg): rounds over the workers of the plan.

Each round the PS sends the global trainable weights to every live worker (each with its own data shard),
collects their compressed updates until all of them answered, the ones that left the plan are given up,
or `round_timeout_s` passes, and applies the aggregate (DiLoCo's outer Nesterov step or FedAvg's mean,
median or trimmed mean). Late updates (from an earlier round) are dropped; a round with none applies
nothing. The reported loss is the mean, over the workers, of their first local step's loss.

The global weights, the round and DiLoCo's outer momentum are committed to JetStream after every
`persist_every` rounds (`cleave_ps.persist`): a PS killed mid-round comes back at the first round not
committed, and the workers' data shards and seeds depend only on the round, so the run goes on as if the PS
had never died.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import structlog
import torch

from cleave.bus import Bus
from cleave.compression import get_compressor, unpack
from cleave.errors import WireError
from cleave.faults import Faults
from cleave.job import JobConfig
from cleave.lifecycle import EXIT_FENCED, wait_for_stop
from cleave.methods.common import trainable
from cleave.methods.diloco import DilocoConfig, DilocoServer
from cleave.methods.fedavg import FedAvgConfig, FedAvgServer
from cleave.methods.lora import attach_lora
from cleave.schedule import lr_at
from cleave.schemas import (
    SUBJECT_ROUNDS,
    SUBJECT_UPDATES,
    PackedTensors,
    RoundTask,
    RoundUpdate,
    StepMetrics,
)
from cleave.training import Trainer
from cleave_ps.persist import Fenced, Progress
from cleave_ps.plan_view import PlanView
from cleave_ps.settings import PsSettings

log = structlog.get_logger("ps")
DEFAULT_POLL_S = 0.05


class Rounds:
    def __init__(self, s: PsSettings, job: JobConfig, bus: Bus, stop: asyncio.Event) -> None:
        self.s, self.job, self.bus, self.stop = s, job, bus, stop
        self.faults = Faults(s.fail_at, s.fault_dir, tag="ps")
        self.progress = Progress(bus, job, s, self.faults)
        self.epoch = 0  # claimed in `start`
        self.plan = PlanView(bus)
        self.losses: dict[str, float] = {}  # sender -> first local loss, this round
        self.failed: set[str] = set()  # workers that answered this round with an error
        self.raw_bytes = self.bytes_up = self.dropped = 0

    def build(self) -> None:
        self.trainer = Trainer(self.job)
        if self.job.lora_rank:
            attach_lora(self.trainer.model, self.job.lora_rank, self.job.lora_alpha, seed=self.job.seed)
        params = trainable(self.trainer.model)
        if self.job.method == "diloco":
            self.server = DilocoServer(params, DilocoConfig(
                inner_steps=self.job.local_steps, outer_lr=self.job.outer_lr,
                outer_momentum=self.job.outer_momentum, rule=self.job.aggregate))
        else:
            self.server = FedAvgServer(params, FedAvgConfig(local_steps=self.job.local_steps, rule=self.job.aggregate))

    @property
    def outer_opt(self) -> torch.optim.Optimizer | None:
        return self.server.opt if isinstance(self.server, DilocoServer) else None

    async def start(self) -> int:
        """Claim an epoch, build the model and the server, restore the last committed round; returns the first
        round to run."""
        self.epoch = await self.progress.open()
        await asyncio.to_thread(self.build)
        first = await self.progress.resume(self.trainer.model, self.outer_opt)
        self.server.load_state_dict({**self.server.state_dict(), "round": first})
        return first

    async def on_update(self, msg: RoundUpdate, nbytes: int) -> None:
        self.bytes_up += nbytes
        if msg.job != self.job.job_id or msg.epoch != self.epoch or msg.error or msg.delta is None:
            self.dropped += 1
            if msg.error and msg.round == self.server.round:  # it answered: the round does not wait for it
                self.failed.add(msg.worker_id)
                log.warning("round_update_failed", worker_id=msg.worker_id, round=msg.round, error=msg.error[:200])
            return
        try:
            delta = await asyncio.to_thread(unpack, msg.delta)
        except WireError as e:
            self.dropped += 1
            self.bus.reject(e.reason, f"update from {msg.worker_id}", str(e))
            return
        verdict = self.server.submit(msg.worker_id, msg.round, delta, msg.weight)
        if verdict != "accepted":
            self.dropped += 1
            return
        self.raw_bytes += msg.raw_bytes
        if msg.losses:
            self.losses[msg.worker_id] = msg.losses[0]

    async def round(self, r: int) -> StepMetrics | None:
        """Run round `r`; None if the PS is stopping (nothing applied: the round runs again after a restart)."""
        t0 = time.perf_counter()
        while not self.plan.workers and not self.stop.is_set():
            await wait_for_stop(self.stop, DEFAULT_POLL_S)
        expected = set(self.plan.workers)
        weights = get_compressor("none")
        packed = {k: weights.compress(v) for k, v in self.server.global_state().items()}
        bytes_down = 0
        for shard, w in enumerate(sorted(expected)):
            task = RoundTask(job=self.job.job_id, epoch=self.epoch, method=self.job.method, round=r,
                             job_config=self.job.model_dump_json(), weights=PackedTensors(tensors=packed),
                             shard=shard, reply=SUBJECT_UPDATES.format(job=self.job.job_id, epoch=self.epoch,
                                                                       worker_id=w))
            bytes_down += await self.bus.publish(SUBJECT_ROUNDS.format(worker_id=w), task)
        self.faults.hit("in_round", r)
        deadline = time.monotonic() + self.job.round_timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            expected &= self.plan.workers  # a worker that left the plan is not waited for
            if self.server.collector.complete(expected - self.failed):
                break
            await wait_for_stop(self.stop, DEFAULT_POLL_S)
        else:
            missing = sorted(expected - self.failed - self.server.collector.senders())
            if missing:
                log.warning("round_timed_out", round=r, missing=missing, timeout_s=self.job.round_timeout_s)
        if self.stop.is_set():
            return None
        report = self.server.close_round()
        losses = [self.losses[w] for w in report.senders if w in self.losses]
        loss = statistics.fmean(losses) if losses else float("nan")
        m = StepMetrics(job=self.job.job_id, method=self.job.method, step=r, loss=loss,
                        step_time_s=time.perf_counter() - t0, workers=len(report.senders), bytes_down=bytes_down,
                        bytes_up=self.bytes_up, raw_bytes_up=self.raw_bytes, updates=len(report.senders),
                        updates_dropped=self.dropped, tokens=len(report.senders) * self.job.local_steps
                        * self.job.batch_size * self.job.seq, lr=lr_at(self.job, r * self.job.local_steps),
                        at=time.time())
        self.losses.clear()
        self.failed.clear()
        self.raw_bytes = self.bytes_up = self.dropped = 0
        return m


async def run_rounds(s: PsSettings, job: JobConfig, bus: Bus, stop: asyncio.Event) -> int:
    rounds = Rounds(s, job, bus, stop)
    first = await rounds.start()
    sub = await bus.subscribe(SUBJECT_UPDATES.format(job=job.job_id, epoch=rounds.epoch, worker_id="*"), RoundUpdate,
                              rounds.on_update, max_bytes=s.max_result_bytes, sender="worker_id")
    log.info("ps_started", job=job.job_id, method=job.method, rounds=job.steps, epoch=rounds.epoch, first=first)
    code = 0
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(rounds.plan.follow(stop))
        try:
            for r in range(first, job.steps):
                if stop.is_set():
                    break
                m = await rounds.round(r)
                if m is None:
                    break
                log.info("round_done", round=r, loss=round(m.loss, 5), workers=m.workers,
                         step_time_s=round(m.step_time_s, 3), bytes_up=m.bytes_up, raw_bytes_up=m.raw_bytes_up)
                await rounds.progress.done(m, rounds.trainer.model, rounds.outer_opt)
            else:
                await rounds.progress.finish(first)
        except Fenced as e:
            log.warning("ps_fenced", reason=str(e))
            code = EXIT_FENCED
        finally:
            stop.set()
            watcher.cancel()
    await sub.unsubscribe()
    return code
