"""PS persistence in JetStream: the checkpoint streamed into the Object Store, then the KV head by compare-and-set.
Pretraining commits its model and AdamW after steps, DiLoCo and FedAvg their global weights (and DiLoCo's
outer momentum) after rounds, split learning its server half and AdamW after steps; `Progress` reports each
step's line once, after the state it led to.

A checkpoint is two objects (`cleave.train.checkpoint`): the tensors' raw bytes, streamed one tensor after
another straight from the live model (no copy of the model is built), and a small manifest with each
tensor's key and shape and each chunk's SHA-256. A crash at any point leaves the previous head and the
checkpoint it names readable: both objects are written first under new names, the head (naming the
manifest, with its SHA-256) is switched last. On load every chunk is checked as it streams in; a truncated
or corrupted checkpoint is rejected with a logged reason and the previous committed head is tried instead.

Fencing: each PS incarnation claims a higher epoch (`<fence_id>.epoch`, compare-and-set), and the PS that
commits claims the head with it in the same compare-and-set that writes it: the head record carries the epoch
of the PS that wrote it, and a head that exists is rewritten with the new epoch at claim time (same
checkpoint). An older PS still running then finds the head moved at its next commit and is fenced (exit 3);
the newer one, whose epoch is still the current one, re-reads the head when a write of an older PS landed
first and writes over it, instead of exiting. So exactly one PS of a job survives.

A job is its job id: a PS started under an id that has state resumes it, whatever its run dir, as long as the
job is still the same model, data order and privacy noise (`cleave.train.identity`); its other settings (`steps`, the learning
rate and its schedule, timeouts, ...) may change from one run to the next. A changed identity is refused once
(`JobChanged`, exit 4: not restarted). The metrics file is only ever appended to: a job's lines from every run,
once per step; a new job finding another job's lines there sets that file aside (renamed, never deleted), and so
does a job resumed from an older checkpoint than its last line (a newer one did not read back), beginning it anew
with the lines up to the checkpoint it resumed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time

import structlog
import torch
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.errors import APIError, KeyNotFoundError
from torch import nn

from cleave import codec
from cleave.bus import DEFAULT_TIMEOUT_S, Bus
from cleave.errors import CleaveError, ConfigError, Conflict, CorruptCheckpoint, Fenced, WireError
from cleave.runtime.faults import Faults
from cleave.runtime.memory import peak_rss_bytes
from cleave.runtime.metrics_file import MetricsFile
from cleave.schemas import MAX_CONTROL_BYTES, STATE_BUCKET, STATE_OBJECTS, Event, StateHead, StepMetrics
from cleave.train import checkpoint, preflight
from cleave.train.checkpoint import DEFAULT_TRANSFER_TIMEOUT_S, Snapshot, read_checkpoint, snapshot
from cleave.train.identity import other_changes, refusal
from cleave.train.job import JobConfig, located
from cleave_ps.settings import PsSettings
from cleave_ps.state import sweep

log = structlog.get_logger("ps")
KEEP_CHECKPOINTS = 2
CHECKPOINT_BUDGET = 0.05  # persist_every=0: commit when the last commit cost <= 5% of the training since
STORE_OVERHEAD_PERCENT = 1  # a checkpoint's chunks take this much more in the store's stream (0.1% measured)
MANIFEST_ALLOWANCE = 1 << 20  # ... and its manifest about 100 bytes a tensor and a 16 MiB chunk (Llama3-1B: 70 kB)
STORE_FULL = 10077  # JetStream's error code for a stream at its max_bytes ('maximum bytes exceeded')
STAGING_SHARE = 0.5  # checkpoint_staging=auto: a staged copy may take at most this share of the free memory
__all__ = ["Fenced", "Persister", "Progress", "snapshot", "write_checkpoint"]


async def write_checkpoint(bus: Bus, store, snap: Snapshot, name: str, on_read=None) -> tuple[bytes, int]:  # noqa: ANN001
    """Stream `snap` into `<name>.data`, then its manifest into `<name>`; the manifest's bytes and the data size."""
    enc = checkpoint.Encoder(snap, on_read=on_read)
    meta = ObjectMeta(name=f"{name}.data", options=ObjectMetaOptions(max_chunk_size=bus.max_payload))
    await asyncio.wait_for(store.put(f"{name}.data", enc, meta=meta), DEFAULT_TRANSFER_TIMEOUT_S)
    manifest = await asyncio.to_thread(codec.encode, enc.manifest(f"{name}.data"))
    await asyncio.wait_for(store.put(name, manifest), DEFAULT_TIMEOUT_S)
    return manifest, enc.size


class Persister:
    def __init__(self, bus: Bus, job_id: str, job_config: str, fence_id: str | None = None,
                 writes_head: bool = True) -> None:
        """`fence_id`: whose epoch this PS claims (a PS replica's own; by default the job's); `writes_head`:
        whether this PS commits (a replica other than 0 does not, and leaves the head alone)."""
        self.bus, self.job_id, self.job_config, self.writes_head = bus, job_id, job_config, writes_head
        self.head_key, self.epoch_key = f"{job_id}.head", f"{fence_id or job_id}.epoch"
        self.revision: int | None = None
        self.epoch = 0
        self.committed: list[str] = []  # object names this PS wrote, oldest first
        self.rejected: list[tuple[int, str]] = []  # (step, reason) of each checkpoint load refused
        self.orphan_age_s = sweep.DEFAULT_ORPHAN_AGE_S  # nameless chunks older than this are purged
        self.collected = sweep.Collected()  # what the last commit's clean-up removed
        self.store_max_bytes: int | None = None  # the checkpoint store's size limit where this PS creates it
        self.store_limit: int | None = None  # the store's limit, whoever created it (None: JetStream's own)

    async def open(self) -> None:
        self.kv = await self.bus.kv(STATE_BUCKET, history=5)
        self.store = await self.bus.object_store(STATE_OBJECTS, self.store_max_bytes)
        limit = (await asyncio.wait_for(self.store.status(), DEFAULT_TIMEOUT_S)).stream_info.config.max_bytes
        self.store_limit = limit if limit and limit > 0 else None

    def check_room(self, snap: Snapshot) -> None:
        """Refuse (ConfigError), before a byte is written, a checkpoint store too small for this job: it holds
        the job's last KEEP_CHECKPOINTS checkpoints and the one being written beside them."""
        one = snap.nbytes * (100 + STORE_OVERHEAD_PERCENT) // 100 + MANIFEST_ALLOWANCE
        need = (KEEP_CHECKPOINTS + 1) * one
        if self.store_limit is not None and need > self.store_limit:
            raise ConfigError(
                f"the checkpoint store (JetStream stream OBJ_{STATE_OBJECTS}) holds at most "
                f"{self.store_limit / 2**20:.1f} MiB, but job {self.job_id!r} keeps its last {KEEP_CHECKPOINTS} "
                f"checkpoints of {one / 2**20:.1f} MiB and writes the next one beside them: {need / 2**20:.1f} MiB. "
                f"Where the PS creates the store, set CLEAVE_PS_STATE_MAX_BYTES to at least {need} (or 0: "
                f"JetStream's own limit); a store that exists keeps the limit it was created with "
                f"(`nats stream edit OBJ_{STATE_OBJECTS} --max-bytes ...`)")

    async def claim_epoch(self) -> int:
        """A new, higher epoch for this PS incarnation (compare-and-set, so two PSs never share one); a PS that
        commits also claims the head with it (`claim_head`)."""
        while True:
            try:
                entry = await asyncio.wait_for(self.kv.get(self.epoch_key), DEFAULT_TIMEOUT_S)
                current, rev = int(entry.value or b"0"), entry.revision
            except Exception:
                current, rev = 0, 0
            try:
                await self.bus.kv_swap(self.kv, self.epoch_key, str(current + 1).encode(), rev or None)
            except Conflict:  # another PS claimed one first: read again
                continue
            self.epoch = current + 1
            if self.writes_head:
                await self.claim_head()
            return self.epoch

    async def claim_head(self) -> None:
        """Write this epoch into the head, naming the same checkpoint (one compare-and-set): from now on no
        older PS's commit lands. Raises Fenced when a newer PS claimed it first."""
        while True:
            entry = await self._head_entry()
            if entry is None:
                self.revision = None  # a new job: the first commit creates the head
                return
            try:
                head = codec.decode(entry.value, StateHead, MAX_CONTROL_BYTES)
            except WireError as e:  # left as it is; the load says what is wrong with it
                log.warning("state_head_rejected", job=self.job_id, revision=entry.revision, reason=str(e))
                return
            if head.epoch > self.epoch:
                raise Fenced(f"epoch {self.epoch} of job {self.job_id} is superseded by {head.epoch}")
            try:
                frame = codec.encode(head.model_copy(update={"epoch": self.epoch}))
                self.revision = await self.bus.kv_swap(self.kv, self.head_key, frame, entry.revision)
                return
            except Conflict:  # an older PS committed meanwhile: claim its head
                continue

    async def _head_entry(self):  # noqa: ANN202 - a nats-py KV entry, or None
        try:
            entry = await self.bus.patiently(lambda: self.kv.get(self.head_key), "state head")
        except KeyNotFoundError:
            return None
        return entry if entry.value else None

    async def _heads(self) -> list[StateHead]:
        """The committed heads of this job, newest first: the head itself, then the revisions before it that
        the KV keeps (the fallbacks of a damaged head)."""
        latest = await self._head_entry()
        if latest is None:
            return []
        entries = await self.bus.history(self.kv, self.head_key, latest.revision - 1)
        heads, seen = [], set()
        for revision, value in [(latest.revision, latest.value), *reversed(entries)]:
            if value:
                try:
                    head = codec.decode(value, StateHead, MAX_CONTROL_BYTES)
                except WireError as e:
                    log.warning("state_head_rejected", job=self.job_id, revision=revision, reason=str(e))
                    continue
                if head.object not in seen:  # a claim repeats the checkpoint of the head before it
                    seen.add(head.object)
                    heads.append(head)
        self.revision = latest.revision
        return heads

    async def load(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> StateHead | None:
        """Restore the last committed checkpoint that reads back intact into `model` and `opt`: its head,
        or None for a new job. A damaged one is logged and the one committed before it is tried."""
        heads = await self._heads()
        if not heads:
            return None
        if refused := refusal(self.job_id, heads[0].job_config, heads[0].step, self.job_config):
            raise refused
        if heads[0].job_config != self.job_config:
            log.info("job_settings_changed", job=self.job_id, **other_changes(heads[0].job_config, self.job_config))
        reasons = []
        for head in heads:
            try:
                await read_checkpoint(self.bus.js, self.store, head, model, opt)
            except CorruptCheckpoint as e:
                log.warning("checkpoint_rejected", job=self.job_id, step=head.step, object=head.object, reason=str(e))
                self.rejected.append((head.step, str(e)))
                reasons.append(str(e))
                self.committed.append(head.object)  # pruned like any old checkpoint
                continue
            self.committed.append(head.object)
            if reasons:
                log.warning("checkpoint_fell_back", job=self.job_id, step=head.step, skipped=len(reasons))
            return head
        raise CleaveError(f"no committed checkpoint of job {self.job_id!r} reads back intact: {'; '.join(reasons)}")

    async def commit(self, snap: Snapshot, metrics: tuple[StepMetrics, ...], before_head=None,
                     on_read=None) -> StateHead:
        """Stream the checkpoint, then switch the head to it; raises Fenced if another PS took over.
        Each metrics line's `checkpoint_s` is filled in with the time the stream took."""
        name = f"{self.job_id}/step-{snap.step:08d}-e{self.epoch}"
        self.check_room(snap)
        t0 = time.perf_counter()
        try:
            manifest, size = await write_checkpoint(self.bus, self.store, snap, name, on_read)
        except APIError as e:
            if e.err_code != STORE_FULL:
                raise
            raise CleaveError(f"the checkpoint store (JetStream stream OBJ_{STATE_OBJECTS}) is full: the checkpoint "
                              f"of step {snap.step} ({snap.nbytes / 2**20:.1f} MiB) does not fit beside what other "
                              "jobs keep there; nothing was committed. Give the store more room (CLEAVE_PS_STATE_MAX_"
                              "BYTES where the PS creates it) or remove the state of jobs that are done") from None
        spent = time.perf_counter() - t0
        if metrics:
            metrics = (*metrics[:-1], metrics[-1].model_copy(update={"checkpoint_s": spent}))
        if before_head:
            before_head()
        head = StateHead(job=self.job_id, step=snap.step, epoch=self.epoch, object=name,
                         sha256=hashlib.sha256(manifest).hexdigest(), size=size, job_config=self.job_config,
                         metrics=metrics)
        frame = codec.encode(head)
        if len(frame) > MAX_CONTROL_BYTES:
            raise CleaveError("state head record over the control message limit")
        await self._check_epoch()
        self.revision = await self._swap_head(frame)
        self.committed.append(name)
        await self._prune()
        return head

    async def _swap_head(self, frame: bytes) -> int:
        """Move the head to `frame` from the revision this PS last saw; its new revision. Tried again while
        the bucket's stream elects a leader (`Bus.patiently`): a try whose answer was lost may have landed,
        so a conflict is this PS's own write when the head now holds `frame`. Another's write is an older
        PS's when the head's epoch is not above ours and ours is still the current epoch: the head is read
        again and written over; else this PS is Fenced."""
        while True:
            try:
                return await self.bus.patiently(
                    lambda: self.bus.kv_swap(self.kv, self.head_key, frame, self.revision), "state head")
            except Conflict:
                entry = await self._head_entry()
            if entry is not None and entry.value == frame:
                return entry.revision
            theirs = self._epoch_of(entry)
            if theirs > self.epoch or not await self._epoch_is_current():
                raise Fenced(f"the head of job {self.job_id} was moved by another PS (epoch {theirs})") from None
            log.warning("state_head_reloaded", job=self.job_id, epoch=self.epoch, overwritten_epoch=theirs)
            self.revision = entry.revision if entry is not None else None

    @staticmethod
    def _epoch_of(entry) -> int:  # noqa: ANN001 - a nats-py KV entry, or None
        """The epoch of the PS that wrote the head (0 when there is none, or it does not decode)."""
        if entry is None:
            return 0
        try:
            return codec.decode(entry.value, StateHead, MAX_CONTROL_BYTES).epoch
        except WireError:
            return 0

    async def _epoch_is_current(self) -> bool:
        entry = await self.bus.patiently(lambda: self.kv.get(self.epoch_key), "epoch check")
        return int(entry.value or b"0") == self.epoch

    async def _check_epoch(self) -> None:
        entry = await self.bus.patiently(lambda: self.kv.get(self.epoch_key), "epoch check")
        if int(entry.value or b"0") != self.epoch:
            raise Fenced(f"epoch {self.epoch} of job {self.job_id} is superseded by {int(entry.value)}")

    async def _prune(self) -> None:
        """Keep the last KEEP_CHECKPOINTS checkpoints; delete this job's others (also those an earlier
        incarnation committed, or wrote and never committed) and the chunks of puts that never finished
        (`cleave_ps.state.sweep`; best effort)."""
        del self.committed[:-KEEP_CHECKPOINTS]
        self.collected = await sweep.collect(self.bus, self.store, STATE_OBJECTS, self.job_id,
                                               set(self.committed), self.orphan_age_s)


class Progress:
    """Steps (or rounds) run but not yet committed: committed with the state that follows them every
    `persist_every` steps and after the last, then published and written to the metrics file, each exactly
    once (lines committed but not written before a crash are published and written on resume)."""

    def __init__(self, bus: Bus, job: JobConfig, s: PsSettings, faults: Faults, fence_id: str | None = None,
                 writes_head: bool = True) -> None:
        self.bus, self.faults, self.job_id, self.steps = bus, faults, job.job_id, job.steps
        # 0 = budgeted for pretraining; the other methods resume exactly only from their last step or round
        self.out, self.every = MetricsFile(s.metrics_out), s.persist_every or (0 if job.method == "cleave" else 1)
        if job.dp_noise and (self.every != 1 or s.checkpoint_staging != "off"):
            raise ConfigError(f"job {job.job_id!r} adds DP noise: each round is committed before its weights go out "
                              "(a round run again after a PS restart would go out twice, counted once in epsilon); "
                              f"it needs persist_every 1 and checkpoint_staging off, not {s.persist_every} and "
                              f"{s.checkpoint_staging!r}")
        self.persister = Persister(bus, job.job_id, located(job), fence_id, writes_head)
        self.persister.store_max_bytes = s.state_max_bytes or None
        self.pending: list[StepMetrics] = []
        self.last_commit_s = 0.0  # seconds the last commit's stream took (persist_every = 0 budgets it)
        self.staging, self.memory_bytes = s.checkpoint_staging, s.memory_bytes
        self.inflight: asyncio.Task | None = None  # a commit streaming a staged copy while training goes on
        self._told = False  # that staging was skipped for want of memory: logged once

    @property
    def epoch(self) -> int:
        return self.persister.epoch

    async def open(self) -> int:
        """Claim this incarnation's epoch (it fences off an older PS of the same job)."""
        await self.persister.open()
        return await self.persister.claim_epoch()

    async def resume(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
        """Restore `model` and `opt` from the last committed checkpoint, report its lines and say so (log and
        event); the first step (or round) to run: 0 for a new job. A checkpoint store too small for the state
        held now is refused here (`check_room`), before a step is run."""
        head = await self.persister.load(model, opt)
        self.check_room(model, opt)
        await asyncio.to_thread(self.set_aside, None if head is None else head.step)
        if head is None:
            return 0
        await self.report(head.metrics)  # lines that were committed but not written before a crash
        first, thrown = head.step + 1, [step for step, _ in self.persister.rejected]
        log.info("ps_resumed", job=self.job_id, from_step=first, epoch=self.epoch, rejected_steps=thrown)
        await self.bus.emit(Event(kind="ps_resumed", at=time.time(), job=self.job_id, step=first, cause="restart",
                                  detail={"epoch": self.epoch, "rejected": len(thrown),
                                          "newest_rejected": max(thrown, default=None)}))
        return first

    def check_room(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        """Refuse a checkpoint store too small for the checkpoint of `model` and `opt` as they are now (an
        optimizer's state exists after its first step: each commit checks again, `Persister.check_room`)."""
        self.persister.check_room(snapshot(model, opt, self.job_id, 0, self.epoch))

    def set_aside(self, after: int | None) -> None:
        """A new job (`after` None): lines already in its metrics file are another job's; a job resumed after step
        `after`: lines of later steps are of checkpoints that did not read back, not of its model. That file is
        renamed, never deleted (and begun anew with its lines up to `after`)."""
        kept = self.out.set_aside(self.job_id) if after is None else self.out.cut_after(after, self.job_id)
        if kept is not None:
            log.warning("metrics_set_aside", job=self.job_id, metrics=str(self.out.path), kept=str(kept))

    def due(self, step: int) -> bool:
        """Commit after `step`? Every `persist_every` steps and after the last; with persist_every = 0, when
        the last commit took at most CHECKPOINT_BUDGET of the training time since it (the first step: always)."""
        if step + 1 == self.steps:
            return True
        if self.every:
            return (step + 1) % self.every == 0
        return self.last_commit_s <= CHECKPOINT_BUDGET * sum(m.step_time_s for m in self.pending)

    async def done(self, m: StepMetrics, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        """Step (or round) `m.step` is over and `model` and `opt` hold its outcome: commit them when due,
        from a staged copy in the background when `checkpoint_staging` allows it (never the last step's)."""
        self.pending.append(m)
        if not self.due(m.step):
            return
        await self.drain()  # one commit at a time, in step order
        snap, lines = snapshot(model, opt, self.job_id, m.step, self.epoch), tuple(self.pending)
        self.pending.clear()
        staged = await self.stage(snap) if m.step + 1 < self.steps else None
        if staged is None:
            await self.commit(snap, lines)
        else:
            self.inflight = asyncio.create_task(self.commit(staged, lines))

    async def stage(self, snap: Snapshot) -> Snapshot | None:
        """A host copy of `snap`'s tensors to stream while the next steps change the live ones; None when
        staging is off or the copy would take more than STAGING_SHARE of the memory still available."""
        if self.staging == "off":
            return None
        need = snap.nbytes
        free = preflight.available_memory()
        if self.memory_bytes:  # the PS's own budget, less what it has held at its peak (a step's comes again)
            free = min(free, self.memory_bytes - peak_rss_bytes())
        if need > STAGING_SHARE * free:
            if not self._told:
                log.info("checkpoint_staging_skipped", job=self.job_id, need_gb=round(need / 1e9, 2),
                         available_gb=round(max(free, 0) / 1e9, 2), share=STAGING_SHARE)
                self._told = True
            return None
        t0 = time.perf_counter()
        copies = await asyncio.to_thread(lambda: {k: v.detach().to("cpu", copy=True) for k, v in snap.tensors.items()})
        log.info("checkpoint_staged", job=self.job_id, step=snap.step, gb=round(need / 1e9, 2),
                 copy_s=round(time.perf_counter() - t0, 3))
        return dataclasses.replace(snap, tensors=copies)

    async def drain(self) -> None:
        """Wait for the commit in the background, if any (its errors, Fenced included, are raised here)."""
        task, self.inflight = self.inflight, None
        if task is not None:
            await task

    async def finish(self, first: int) -> None:
        """Every step (or round) is committed: say so, in the log and as a `job_done` event."""
        await self.drain()
        log.info("job_done", job=self.job_id, steps=self.steps, first=first, epoch=self.epoch)
        await self.bus.emit(Event(kind="job_done", at=time.time(), job=self.job_id, step=self.steps - 1,
                                  detail={"steps": self.steps, "first": first, "epoch": self.epoch}))

    async def commit(self, snap: Snapshot, lines: tuple[StepMetrics, ...]) -> None:
        """Persist `snap` with `lines` (the steps up to it), then report them; raises Fenced."""
        step = snap.step
        head = await self.persister.commit(snap, lines,
                                           before_head=lambda: self.faults.hit("before_commit", step),
                                           on_read=lambda: self.faults.hit("mid_commit", step))
        self.faults.hit("after_commit", step)
        self.last_commit_s = head.metrics[-1].checkpoint_s if head.metrics else 0.0
        await self.report(head.metrics)

    async def report(self, lines: tuple[StepMetrics, ...] | list[StepMetrics]) -> None:
        """Tell the events stream of each line (its recoveries first) and write it, where the metrics file does
        not hold it yet: a resume re-reports its head's lines, and re-tells none already told. Without a metrics
        file the PS cannot know, and tells them all (the monitor drops a line it has seen)."""
        written = await asyncio.to_thread(self.out.steps)
        for m in lines:
            if m.step in written:
                continue
            for ev in m.recovery:
                await self.bus.emit(ev)
            await self.bus.emit(m)
            await asyncio.to_thread(self.out.write, m)

