"""The worker's rounds (DiLoCo, FedAvg: train locally, send the update) and its half of split learning, each
run off the event loop; a failure spoils that round's or step's answer, never the worker. The job's base
weights and tokenizer are fetched from the PS's bundles first (once per job, cached by hash)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cleave import bus as busmod
from cleave import codec
from cleave.errors import JobRefused
from cleave.models.bundles import BundleCache
from cleave.schemas import RoundTask, RoundUpdate, SplitReply, SplitTask
from cleave_worker.device import DeviceState
from cleave_worker.local_rounds import RoundRunner
from cleave_worker.split_client import SplitRunner


class Methods:
    def __init__(self, device: DeviceState, bus: busmod.Bus) -> None:
        self.device, self.s, self.bus, self.log = device, device.s, bus, device.log
        self.rounds = RoundRunner(self.s.worker_id, self.s.data, self.s.round_memory_bytes, self.s.lie_weight)
        self.split = SplitRunner(self.s.worker_id, self.s.data)
        self.bundles = BundleCache(self.s.model_cache)

    async def fetch(self, bundle_id: str) -> Path | None:
        """The local directory of a published bundle ("" : none)."""
        return await self.bundles.fetch(self.bus, bundle_id) if bundle_id else None

    async def on_round(self, task: RoundTask, nbytes: int) -> None:
        """A data-parallel round (diloco, fedavg): train locally off the event loop, send the update."""
        self.device.faults.hit("round", task.round)
        arrived = time.time()
        try:
            base, tok = await self.fetch(task.base_bundle), await self.fetch(task.tokenizer_bundle)
            with self.device.busy():
                update = await asyncio.to_thread(self.rounds.run, task, base, tok)
        except Exception as e:  # a bad task spoils this round's update, not the worker
            refused = isinstance(e, JobRefused)
            self.log.warning("round_refused" if refused else "round_failed", job=task.job, round=task.round,
                             error=str(e) if refused else repr(e))
            update = RoundUpdate(job=task.job, epoch=task.epoch, round=task.round, worker_id=self.s.worker_id,
                                 error=(str(e) if refused else repr(e))[:500], refused=refused)
        else:
            if self.device.pacer is not None:  # behave like the declared device: answer when it would have
                up = len(await asyncio.to_thread(codec.encode, update))
                done = self.device.pacer.finish_at(arrived, nbytes, up, self.rounds.flops(task, base, tok))
                await asyncio.sleep(max(0.0, done - time.time()))
        await self.bus.publish(task.reply.replace("{worker_id}", self.s.worker_id), update)  # its own subject

    async def on_roundcast(self, task: RoundTask, nbytes: int) -> None:
        """A round published once for all its workers: take part if this worker is named in it."""
        shard = task.shards.get(self.s.worker_id)
        if shard is not None:
            await self.on_round(task.model_copy(update={"shard": shard, "shards": {}}), nbytes)

    async def on_split(self, task: SplitTask, nbytes: int) -> None:
        """Split learning: this worker is the client; run its half of the step off the event loop."""
        self.device.faults.hit("split", task.step)
        try:
            tok = await self.fetch(task.tokenizer_bundle)
            reply = await asyncio.to_thread(self.split.run, task, tok)
        except Exception as e:  # the PS hears why, and the step is not half-applied silently
            self.log.warning("split_step_failed", job=task.job, step=task.step, phase=task.phase, error=repr(e))
            reply = SplitReply(job=task.job, epoch=task.epoch, step=task.step, phase=task.phase,
                               worker_id=self.s.worker_id, error=repr(e)[:500])
        await self.bus.publish(task.reply, reply)
