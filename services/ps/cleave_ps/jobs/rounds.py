"""The PS's side of the data-parallel methods (diloco, fedavg): rounds over the workers of the plan.

Each round the PS sends the global trainable weights to every live worker (each with its own data shard),
collects their compressed updates until all of them answered (the ones that left the plan are given up),
`min_updates` of them arrived, or `round_timeout_s` passes, and applies the aggregate (DiLoCo's outer
Nesterov step or FedAvg's mean, median or trimmed mean). Late updates (from an earlier round) count when at
most `max_staleness` rounds old, weighted 1/(1+age); a round with fewer than max(1, min_updates) applies
nothing. The reported loss is the mean, over the workers, of their first local step's loss; with `val_every`
the validation loss of the PS's model after the round. Every worker whose update will not come (it left the
plan, the round timed out, or it answered with an error) is a recovery event in the round's metrics line.

Every worker is untrusted: an update counts only from a member of the round it names (the workers it was
dealt to), weighted by the tokens the PS dealt it (never by what it claims), its L2 norm clipped to
`update_clip`; with `own_data` only from a member that trains on data of its own. A member that refuses the
job (no own data, not enough memory) is not dealt it again. A round in which no update was accepted is not
a round: its number, the data and the learning rate stay, it runs again (after 2 s, then 4, 8, ...: time for
a fleet that flapped to come back), and after `max_empty_rounds` in a row the job fails (`RoundsFailed`,
exit status 4) with what the PS saw.

The job's base weights and tokenizer are served to the workers from this PS's disk (`cleave.models.bundles`);
the round tasks name them. With `secagg` a round's updates arrive masked and only their sum is recovered
(`cleave_ps.jobs.secure`); with `dp_noise` the FedAvg server adds calibrated Gaussian noise to each round's sum
and every metrics line carries the epsilon spent so far (`cleave.methods.privacy`).

The global weights, the round and DiLoCo's outer momentum are committed to JetStream after every
`persist_every` rounds (`cleave_ps.state.persist`): a PS killed mid-round comes back at the first round not
committed, and the workers' data shards and seeds depend only on the round, so the run goes on as if the PS
had never died.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import structlog
import torch

from cleave.bus import Bus
from cleave.compression import get_compressor, unpack
from cleave.errors import RoundsFailed, WireError
from cleave.methods.aggregate import clip_update, round_loss, trim_cut
from cleave.methods.common import trainable
from cleave.methods.diloco import DilocoConfig, DilocoServer
from cleave.methods.fedavg import FedAvgConfig, FedAvgServer
from cleave.methods.lora import attach_for_job
from cleave.methods.privacy import epsilon
from cleave.models import bundles
from cleave.runtime.faults import Faults
from cleave.schemas import (
    PLAN_KEY,
    SUBJECT_ROUNDCAST,
    SUBJECT_UPDATES,
    Event,
    PackedTensors,
    Plan,
    RoundTask,
    RoundUpdate,
    StepMetrics,
)
from cleave.train.job import JobConfig
from cleave.train.schedule import lr_at
from cleave.train.trainer import Trainer
from cleave_ps.fleet.idle import NOTICE_S, WaitNotice
from cleave_ps.fleet.plans import PlanWatch, first_of
from cleave_ps.jobs.lifecycle import Listen
from cleave_ps.jobs.secure import SecureRound
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Progress

log = structlog.get_logger("ps")
DEFAULT_EMPTY_BACKOFF_S = 2.0  # before the first rerun of a round that accepted nothing; doubled each time after


class Rounds:
    """The rounds driver of a job's lifecycle (`lifecycle.Driver`): DiLoCo or FedAvg over the plan's workers."""

    plan_key = PLAN_KEY

    def __init__(self, s: PsSettings, job: JobConfig, bus: Bus, stop: asyncio.Event) -> None:
        self.s, self.job, self.bus, self.stop = s, job, bus, stop
        self.idle = WaitNotice(bus, job.job_id, NOTICE_S)  # no worker in the plan yet
        self.faults = Faults(s.fail_at, s.fault_dir, tag="ps")
        self.progress = Progress(bus, job, s, self.faults)
        self.epoch = 0  # claimed before `build`
        self.first = 0  # the first round this PS runs (> 0: it resumed from persisted state)
        self.news = asyncio.Event()  # an update arrived or the plan changed: the round may close
        self.losses: dict[str, float] = {}  # sender -> first local loss, this round
        self.failed: dict[str, str] = {}  # workers that answered this round with an error, and the error
        self.failed_at: dict[str, float] = {}  # ... and when it came (perf_counter)
        self.round_started = 0.0  # perf_counter at the round's first attempt: its events and its time count from it
        self.carried: list[Event] = []  # workers lost in this round's attempts that accepted nothing
        self.refused: dict[str, str] = {}  # workers that refused the job, and why: not dealt it again
        self.members: dict[int, frozenset[str]] = {}  # round -> the workers it was dealt to
        self.rejected: dict[str, int] = {}  # this round's refused updates, by reason
        self.told_trim = False  # that a trimmed round had too few updates to drop any: logged once
        self.bundles = {"model": "", "tokenizer": ""}  # the job's published base weights and tokenizer
        self.shelf = bundles.Shelf()  # ... served to the workers from this PS's disk
        self.secure: SecureRound | None = None  # the round in flight's secure aggregation (secagg)
        # every member's weight: the tokens the PS deals it per round (what it claims is ignored)
        self.weight = float(job.local_steps * job.batch_size * job.seq)
        self.raw_bytes = self.bytes_up = self.dropped = 0

    def _build(self) -> None:
        self.trainer = Trainer(self.job)
        attach_for_job(self.trainer.model, self.job)
        params = trainable(self.trainer.model)
        j = self.job
        common = dict(rule=j.aggregate, max_staleness=j.max_staleness, min_updates=max(1, j.min_updates))
        if j.method == "diloco":
            self.server = DilocoServer(params, DilocoConfig(
                inner_steps=j.local_steps, outer_lr=j.outer_lr, outer_momentum=j.outer_momentum, **common))
        else:
            self.server = FedAvgServer(params, FedAvgConfig(local_steps=j.local_steps, dp_noise=j.dp_noise,
                                                            clip=j.update_clip, **common))

    @property
    def outer_opt(self) -> torch.optim.Optimizer | None:
        return self.server.opt if isinstance(self.server, DilocoServer) else None

    async def join(self) -> None:
        """Nothing to agree on before the epoch."""

    async def build(self, epoch: int, plans: PlanWatch) -> None:
        """The model and the DiLoCo or FedAvg server, for this epoch; the base weights and tokenizer published."""
        self.epoch, self.plan = epoch, plans
        await asyncio.to_thread(self._build)
        files = await asyncio.to_thread(bundles.job_files, self.job.init_from, self.job.tokenizer)
        for kind, paths in files.items():
            self.bundles[kind] = await self.shelf.publish(self.bus, kind, paths)

    async def resume(self) -> int:
        """Restore the last committed round; the first round to run."""
        first = self.first = await self.progress.resume(self.trainer.model, self.outer_opt)
        self.server.load_state_dict({**self.server.state_dict(), "round": first})
        log.info("ps_started", job=self.job.job_id, method=self.job.method, rounds=self.job.steps, epoch=self.epoch,
                 first=first)
        return first

    def listens(self, epoch: int) -> list[Listen]:
        return [Listen(SUBJECT_UPDATES.format(job=self.job.job_id, epoch=epoch, worker_id="*"), RoundUpdate,
                       self.on_update, dict(max_bytes=self.s.max_result_bytes, sender="worker_id"))]

    async def on_plan(self, plan: Plan) -> None:
        self.news.set()  # a worker may have left: the round stops waiting for it

    def refuse(self, reason: str, msg: RoundUpdate, detail: str = "") -> None:
        self.dropped += 1
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.bus.reject(reason, f"update from {msg.worker_id} for round {msg.round}", detail)

    async def on_update(self, msg: RoundUpdate, nbytes: int) -> None:
        self.bytes_up += nbytes
        if msg.job != self.job.job_id or msg.epoch != self.epoch:
            self.dropped += 1
            return
        if msg.worker_id not in self.members.get(msg.round, ()):
            if msg.round < self.server.round - self.job.max_staleness:  # (its members are forgotten: a straggler)
                return self.refuse("update_late", msg, f"round {msg.round} closed; updates more than "
                                   f"max_staleness={self.job.max_staleness} rounds old are dropped")
            return self.refuse("not_member", msg, "it was not dealt that round")
        if msg.error:
            self.dropped += 1
            if msg.refused and msg.worker_id not in self.refused:
                self.refused[msg.worker_id] = msg.error
                log.warning("round_member_refused", worker_id=msg.worker_id, reason=msg.error[:300])
            if msg.round == self.server.round:  # it answered: the round does not wait for it
                self.failed[msg.worker_id], self.failed_at[msg.worker_id] = msg.error, time.perf_counter()
                self.news.set()
                log.warning("round_update_failed", worker_id=msg.worker_id, round=msg.round, error=msg.error[:200])
            return
        if self.job.own_data and msg.data_tokens <= 0 and (msg.secagg is None or msg.secagg.phase == "masked"):
            return self.refuse("no_own_data", msg, "the job trains on its members' own data")
        if self.job.secagg:
            return self.on_secure(msg)
        if msg.delta is None:
            return self.refuse("no_delta", msg)
        try:
            delta = await asyncio.to_thread(unpack, msg.delta)
        except WireError as e:
            return self.refuse(e.reason, msg, str(e))
        if self.job.update_clip > 0:
            delta, before = await asyncio.to_thread(clip_update, delta, self.job.update_clip)
            if before > self.job.update_clip:
                log.info("update_clipped", worker_id=msg.worker_id, round=msg.round, norm=round(before, 6))
        verdict = self.server.submit(msg.worker_id, msg.round, delta, self.weight)
        if verdict != "accepted":
            return self.refuse(f"update_{verdict}", msg)
        self.raw_bytes += msg.raw_bytes
        if msg.losses:
            self.losses[msg.worker_id] = msg.losses[0]
        self.news.set()

    def on_secure(self, msg: RoundUpdate) -> None:
        """A phase message of secure aggregation, for the round in flight only."""
        why = self.secure.on_update(msg) if self.secure is not None and msg.round == self.secure.r else "secagg_round"
        if why is not None:
            return self.refuse(why, msg)
        if msg.secagg is not None and msg.secagg.phase == "masked":
            self.raw_bytes += msg.raw_bytes
            if msg.losses:
                self.losses[msg.worker_id] = msg.losses[0]

    async def deal(self, r: int, expected: set[str]) -> int:
        """Publish round `r`'s global weights once for every expected worker (each named with its data shard;
        NATS fans the message out); the bytes sent, which are also what each worker receives."""
        weights = get_compressor("none")
        packed = {k: weights.compress(v) for k, v in self.server.global_state().items()}
        task = RoundTask(job=self.job.job_id, epoch=self.epoch, method=self.job.method, round=r,
                         job_config=self.job.model_dump_json(), weights=PackedTensors(tensors=packed),
                         reply=SUBJECT_UPDATES.format(job=self.job.job_id, epoch=self.epoch, worker_id="{worker_id}"),
                         shards={w: shard for shard, w in enumerate(sorted(expected))},
                         base_bundle=self.bundles["model"], tokenizer_bundle=self.bundles["tokenizer"])
        if self.job.secagg:  # a fresh session (and fresh keys) for every attempt at the round
            self.secure = SecureRound(self, r, secrets.token_hex(8))
            task = task.model_copy(update={"session": self.secure.session})
        self.members[r] = frozenset(expected)
        for old in [k for k in self.members if k < r - self.job.max_staleness]:
            del self.members[old]
        return await self.bus.publish(SUBJECT_ROUNDCAST.format(job=self.job.job_id), task)

    def closes(self, expected: set[str]) -> bool:
        """Every expected worker answered (or failed), or `min_updates` updates of this round arrived."""
        got = self.server.collector.senders()
        return expected - set(self.failed) <= got or 0 < self.job.min_updates <= len(got)

    async def collect(self, r: int, expected: set[str], t0: float) -> list[Event]:
        """Wait until the round closes (`closes`, or the timeout); a recovery event per worker lost in it."""
        lost: list[Event] = []
        expected = set(expected)  # (the caller's stays whole: it reports who was dealt the round)
        deadline = time.monotonic() + self.job.round_timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.news.clear()
            gone = expected - self.plan.workers - self.server.collector.senders()
            for w in sorted(gone):  # a worker that left the plan before its update came is not waited for
                lost.append(self.lost(r, w, "left_plan", t0))
            expected &= self.plan.workers
            if self.closes(expected):
                break
            await first_of(self.news, self.stop, timeout_s=max(0.0, deadline - time.monotonic()))
        else:
            missing = sorted(expected - set(self.failed) - self.server.collector.senders())
            if missing and not self.stop.is_set():
                log.warning("round_timed_out", round=r, missing=missing, timeout_s=self.job.round_timeout_s)
                lost += [self.lost(r, w, "round_timeout", t0) for w in missing]
        lost += [self.lost(r, w, "update_failed", t0, self.failed_at.get(w)) for w in sorted(self.failed)]
        return lost

    def lost(self, r: int, worker: str, cause: str, t0: float, at: float | None = None) -> Event:
        """A worker whose update for round `r` will not come (`at`: when the PS learnt it, if not now): what the PS
        saw and what it did about it."""
        detect_s = (at or time.perf_counter()) - t0
        log.warning("round_worker_lost", round=r, worker_id=worker, cause=cause, detect_s=round(detect_s, 3))
        return Event(kind="recovered", at=time.time(), job=self.job.job_id, step=r, worker_id=worker, cause=cause,
                     detect_s=detect_s, detail={"round": r, "dropped": "its update for this round",
                                                "redone": "nothing: the round closes with the other updates"})

    async def step(self, r: int) -> StepMetrics | None:
        """Run round `r` until an update is accepted (at most `max_empty_rounds` tries); None if the PS is
        stopping (nothing applied: the round runs again after a restart)."""
        seen: list[str] = []
        self.round_started, self.carried = time.perf_counter(), []
        while True:
            m = await self.attempt(r, len(seen))
            if m is None or isinstance(m, StepMetrics):
                return m
            seen.append(m)
            log.warning("round_empty", round=r, attempt=len(seen), reason=m)
            if len(seen) >= self.job.max_empty_rounds:
                raise RoundsFailed(f"{len(seen)} rounds in a row (round {r}) ended with no accepted update "
                                   f"(max_empty_rounds={self.job.max_empty_rounds}): " + "; ".join(seen))
            # a fleet that flapped (heartbeats late on a loaded machine) gets time to come back before the rerun
            backoff = min(self.job.round_timeout_s, DEFAULT_EMPTY_BACKOFF_S * 2 ** (len(seen) - 1))
            await first_of(self.stop, timeout_s=backoff)

    def why_empty(self, expected: set[str], lost: list[Event], silent: bool = True) -> str:
        """What the PS saw in a round that accepted nothing (`silent`: name the members that sent nothing)."""
        parts = [f"{ev.worker_id} left plan" for ev in lost if ev.cause == "left_plan"]
        if timed_out := sorted({ev.worker_id for ev in lost if ev.cause == "round_timeout"}):
            parts.append(f"no update from {', '.join(timed_out)} within round_timeout_s={self.job.round_timeout_s} "
                         "(--round-timeout)")
        if not expected:
            parts.append("no worker to deal it to" + (f" ({len(self.refused)} refused the job: " + "; ".join(
                f"{w}: {e[:200]}" for w, e in sorted(self.refused.items())) + ")" if self.refused else ""))
        parts += [f"{w} failed: {e[:200]}" for w, e in sorted(self.failed.items())]
        if self.rejected:
            parts.append("updates refused: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.rejected.items())))
        quiet = expected - set(self.failed) - {ev.worker_id for ev in lost}
        if silent and quiet and not self.rejected:
            parts.append(f"no update from {', '.join(sorted(quiet))} within round_timeout_s="
                         f"{self.job.round_timeout_s}")
        return "; ".join(parts) or "nothing arrived"

    async def attempt(self, r: int, tried: int) -> StepMetrics | str | None:
        """Deal round `r` and close it: its metrics line, or (nothing accepted) what the PS saw, or None."""
        t0 = time.perf_counter()
        expected = set(await self.plan.some_workers(self.stop, lambda: self.idle.waiting(r))) - set(self.refused)
        bytes_down = per_worker = await self.deal(r, expected)  # (the round's broadcast: every worker gets it)
        self.faults.hit("in_round", r)
        if self.secure is not None:
            total, survivors, lost, why = await self.secure.run(expected, t0)
            bytes_down += self.secure.bytes_down
            per_worker += max(self.secure.bytes_to.values(), default=0)  # (and the most any member got of its own)
        else:
            lost, why = await self.collect(r, expected, t0), None
        if self.stop.is_set():
            return None
        lost = [ev.model_copy(update={"detect_s": (ev.detect_s or 0.0) + t0 - self.round_started}) for ev in lost]
        if self.secure is not None:
            report = self.server.close_with_sum(total, survivors)
        else:
            report = self.server.close_round()
        if not report.senders:
            why = "; ".join(x for x in (why, self.why_empty(expected, lost, silent=why is None)) if x)
        losses = [self.losses[w] for w in report.senders if w in self.losses]
        trim = self.server.cfg.trim
        if self.job.aggregate == "trimmed" and report.senders and not trim_cut(len(report.senders), trim) \
                and not self.told_trim:
            log.warning("trimmed_drops_nothing", round=r, updates=len(report.senders), trim=trim)
            self.told_trim = True  # (and in the events stream: `cleave status` says it beside the job)
            await self.bus.emit(Event(kind="trimmed_drops_nothing", at=time.time(), job=self.job.job_id, step=r,
                                      detail={"updates": len(report.senders), "trim": trim}))
        self.losses.clear()
        self.failed.clear()
        self.failed_at.clear()
        self.rejected.clear()
        if why is not None:
            self.raw_bytes = self.bytes_up = self.dropped = 0
            self.carried += lost  # (reported with the round once an attempt of it is applied)
            return why
        closed = time.perf_counter()
        lost = [ev.model_copy(update={"complete_s": closed - self.round_started - ev.detect_s})
                for ev in self.carried + lost]
        val = None
        if self.job.val_every and (r + 1) % self.job.val_every == 0:
            val = await asyncio.to_thread(self.trainer.val_loss, r)
        m = StepMetrics(job=self.job.job_id, method=self.job.method, step=r,
                        loss=round_loss(losses, self.job.aggregate, trim), val_loss=val,
                        step_time_s=time.perf_counter() - self.round_started, workers=len(report.senders),
                        bytes_down=bytes_down,
                        bytes_down_per_worker=per_worker,
                        bytes_up=self.bytes_up, raw_bytes_up=self.raw_bytes, updates=len(report.senders),
                        updates_dropped=self.dropped, tokens=len(report.senders) * self.job.local_steps
                        * self.job.batch_size * self.job.seq, lr=lr_at(self.job, r * self.job.local_steps), recoveries=len(lost),
                        recovery=tuple(lost), applied=report.applied, updates_late=report.late_folded,
                        dp_epsilon=epsilon(self.job.dp_noise, r + 1, self.job.dp_delta) if self.job.dp_noise else None,
                        resumed=self.first > 0, at=time.time())
        self.raw_bytes = self.bytes_up = self.dropped = 0
        log.info("round_done", round=r, loss=round(m.loss, 5), workers=m.workers, val_loss=m.val_loss,
                 step_time_s=round(m.step_time_s, 3), bytes_up=m.bytes_up, raw_bytes_up=m.raw_bytes_up,
                 empty_before=tried)
        return m

    async def commit(self, m: StepMetrics) -> None:
        await self.progress.done(m, self.trainer.model, self.outer_opt)

    async def finish(self, first: int) -> None:
        await self.progress.finish(first)

    def stopping(self) -> None:
        """The round in flight sees the stop itself (it waits on it) and applies nothing."""

    def close(self) -> None:
        """Nothing is held outside this process."""
