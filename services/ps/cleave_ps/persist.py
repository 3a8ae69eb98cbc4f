"""PS persistence in JetStream: the checkpoint in the Object Store, then the KV head by compare-and-set.
Pretraining commits its model and AdamW after steps, DiLoCo and FedAvg their global weights (and DiLoCo's
outer momentum) after rounds, split learning its server half and AdamW after steps; `Progress` reports each
step's line once, after the state it led to.

A crash at any point leaves the previous head and the checkpoint it names readable: the object is written
first under a new name, the head is switched to it last, and a checkpoint is checked against the head's
SHA-256 before it is used. The epoch counter fences off an older PS that is still alive.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import structlog
import torch
from torch import nn

from cleave import codec
from cleave.bus import DEFAULT_TIMEOUT_S, Bus
from cleave.errors import CleaveError, ConfigError, Conflict
from cleave.faults import Faults
from cleave.job import JobConfig
from cleave.metrics_file import MetricsFile
from cleave.schemas import (
    MAX_CONTROL_BYTES,
    STATE_BUCKET,
    STATE_OBJECTS,
    Checkpoint,
    Event,
    StateHead,
    StepMetrics,
)
from cleave_ps.settings import PsSettings

log = structlog.get_logger("ps")
MAX_CHECKPOINT_BYTES = 16 * 1024 * 1024 * 1024
DEFAULT_PUT_TIMEOUT_S = 120.0
KEEP_CHECKPOINTS = 2


class Fenced(CleaveError):
    """Another PS took over this job (a higher epoch committed or claimed it)."""


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None, job_id: str, step: int, epoch: int) -> Checkpoint:
    """The model's weights, the optimizer's state (the trainer's AdamW, or DiLoCo's outer SGD; none for FedAvg)
    and the RNG, after `step` (a training step, or a round)."""
    tensors = {f"model.{k}": codec.tensor_to_data(v) for k, v in model.state_dict().items()}
    state = opt.state_dict() if opt is not None else {"state": {}, "param_groups": []}
    for idx, values in state["state"].items():
        for name, value in values.items():
            tensors[f"opt.{idx}.{name}"] = codec.tensor_to_data(torch.as_tensor(value))
    return Checkpoint(job=job_id, step=step, epoch=epoch, created_at=time.time(), tensors=tensors,
                      optimizer_groups=state["param_groups"], rng=codec.tensor_to_data(torch.get_rng_state()))


def restore(model: nn.Module, opt: torch.optim.Optimizer | None, ckpt: Checkpoint) -> None:
    """Load weights, optimizer state and RNG; key sets are checked before anything is copied."""
    weights = {k.removeprefix("model."): codec.data_to_tensor(v) for k, v in ckpt.tensors.items() if k.startswith("model.")}
    missing = set(model.state_dict()) ^ set(weights)
    if missing:
        raise ConfigError(f"checkpoint of step {ckpt.step} does not fit this model: keys {sorted(missing)[:5]}")
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in ckpt.tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = codec.data_to_tensor(v)
    if (opt is None) != (not ckpt.optimizer_groups):
        raise ConfigError(f"checkpoint of step {ckpt.step} does not fit this job's optimizer")
    model.load_state_dict(weights)
    if opt is not None:
        opt.load_state_dict({"state": state, "param_groups": ckpt.optimizer_groups})
    torch.set_rng_state(codec.data_to_tensor(ckpt.rng))


class Persister:
    def __init__(self, bus: Bus, job_id: str, job_config: str) -> None:
        self.bus, self.job_id, self.job_config = bus, job_id, job_config
        self.head_key, self.epoch_key = f"{job_id}.head", f"{job_id}.epoch"
        self.revision: int | None = None
        self.epoch = 0
        self.committed: list[str] = []  # object names this PS wrote, oldest first

    async def open(self) -> None:
        self.kv = await self.bus.kv(STATE_BUCKET, history=5)
        self.store = await self.bus.object_store(STATE_OBJECTS)

    async def claim_epoch(self) -> int:
        """A new, higher epoch for this PS incarnation (compare-and-set, so two PSs never share one)."""
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
            return self.epoch

    async def load(self) -> tuple[StateHead, Checkpoint] | None:
        """The last committed head and its checkpoint, or None for a new job."""
        got = await self.bus.kv_get(self.kv, self.head_key, StateHead)
        if got is None:
            return None
        head, self.revision = got
        self.committed = [head.object]
        if head.job_config != self.job_config:
            raise ConfigError(f"job {self.job_id!r} already has state from a different job description; "
                              "use a new job_id or the same job file")
        obj = await asyncio.wait_for(self.store.get(head.object), DEFAULT_PUT_TIMEOUT_S)
        data = obj.data
        if hashlib.sha256(data).hexdigest() != head.sha256:
            raise CleaveError(f"checkpoint {head.object} does not match its head record (sha256)")
        ckpt = await asyncio.to_thread(codec.decode, data, Checkpoint, MAX_CHECKPOINT_BYTES)
        return head, ckpt

    async def commit(self, ckpt: Checkpoint, metrics: tuple[StepMetrics, ...], before_head=None) -> StateHead:
        """Write the checkpoint object, then switch the head to it; raises Fenced if another PS took over."""
        data = await asyncio.to_thread(codec.encode, ckpt)
        name = f"{self.job_id}/step-{ckpt.step:08d}-e{self.epoch}"
        await asyncio.wait_for(self.store.put(name, data), DEFAULT_PUT_TIMEOUT_S)
        if before_head:
            before_head()
        head = StateHead(job=self.job_id, step=ckpt.step, epoch=self.epoch, object=name,
                         sha256=hashlib.sha256(data).hexdigest(), size=len(data), job_config=self.job_config,
                         metrics=metrics)
        frame = codec.encode(head)
        if len(frame) > MAX_CONTROL_BYTES:
            raise CleaveError("state head record over the control message limit")
        await self._check_epoch()
        try:
            self.revision = await self.bus.kv_swap(self.kv, self.head_key, frame, self.revision)
        except Conflict:
            raise Fenced(f"the head of job {self.job_id} was moved by another PS") from None
        self.committed.append(name)
        await self._prune()
        return head

    async def _check_epoch(self) -> None:
        entry = await asyncio.wait_for(self.kv.get(self.epoch_key), DEFAULT_TIMEOUT_S)
        if int(entry.value or b"0") != self.epoch:
            raise Fenced(f"epoch {self.epoch} of job {self.job_id} is superseded by {int(entry.value)}")

    async def _prune(self) -> None:
        """Delete checkpoints older than the last KEEP_CHECKPOINTS (best effort)."""
        while len(self.committed) > KEEP_CHECKPOINTS:
            name = self.committed.pop(0)
            try:
                await asyncio.wait_for(self.store.delete(name), DEFAULT_TIMEOUT_S)
            except Exception as e:
                log.warning("checkpoint_not_pruned", object=name, error=repr(e))


class Progress:
    """Steps (or rounds) run but not yet committed: committed with the state that follows them every
    `persist_every` steps and after the last, then written to the metrics file and published, each exactly
    once (lines committed but not written before a crash are written on resume)."""

    def __init__(self, bus: Bus, job: JobConfig, s: PsSettings, faults: Faults) -> None:
        self.bus, self.faults, self.job_id, self.steps = bus, faults, job.job_id, job.steps
        self.out, self.every = MetricsFile(s.metrics_out), s.persist_every
        self.persister = Persister(bus, job.job_id, job.model_dump_json())
        self.pending: list[StepMetrics] = []

    @property
    def epoch(self) -> int:
        return self.persister.epoch

    async def open(self) -> int:
        """Claim this incarnation's epoch (it fences off an older PS of the same job)."""
        await self.persister.open()
        return await self.persister.claim_epoch()

    async def resume(self, model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
        """Restore `model` and `opt` from the last committed checkpoint, report its lines and say so (log and
        event); the first step (or round) to run: 0 for a new job."""
        loaded = await self.persister.load()
        if loaded is None:
            return 0
        head, ckpt = loaded
        await asyncio.to_thread(restore, model, opt, ckpt)
        await self.report(head.metrics)  # lines that were committed but not written before a crash
        first = ckpt.step + 1
        log.info("ps_resumed", job=self.job_id, from_step=first, epoch=self.epoch)
        await self.bus.emit(Event(kind="ps_resumed", at=time.time(), job=self.job_id, step=first, cause="restart",
                                  detail={"epoch": self.epoch}))
        return first

    async def done(self, m: StepMetrics, model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
        """Step (or round) `m.step` is over and `model` and `opt` hold its outcome: commit them when due."""
        self.pending.append(m)
        if (m.step + 1) % self.every == 0 or m.step + 1 == self.steps:
            await self.commit(await asyncio.to_thread(snapshot, model, opt, self.job_id, m.step, self.epoch))

    async def finish(self, first: int) -> None:
        """Every step (or round) is committed: say so, in the log and as a `job_done` event."""
        log.info("job_done", job=self.job_id, steps=self.steps, first=first, epoch=self.epoch)
        await self.bus.emit(Event(kind="job_done", at=time.time(), job=self.job_id, step=self.steps - 1,
                                  detail={"steps": self.steps, "first": first, "epoch": self.epoch}))

    async def commit(self, ckpt: Checkpoint) -> None:
        """Persist `ckpt` with the lines of the steps up to it, then report them; raises Fenced."""
        lines = tuple(self.pending)
        await self.persister.commit(ckpt, lines, before_head=lambda: self.faults.hit("before_commit", ckpt.step))
        self.faults.hit("after_commit", ckpt.step)
        self.pending.clear()
        await self.report(lines)

    async def report(self, lines: tuple[StepMetrics, ...] | list[StepMetrics]) -> None:
        written = await asyncio.to_thread(self.out.steps)
        for m in lines:
            if m.step not in written:
                await asyncio.to_thread(self.out.write, m)
            for ev in m.recovery:
                await self.bus.emit(ev)
            await self.bus.emit(m)

