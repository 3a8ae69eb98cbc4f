"""The worker's rounds (DiLoCo, FedAvg: train locally, send the update) and its half of split learning, each
run off the event loop; a failure spoils that round's or step's answer, never the worker."""

from __future__ import annotations

import asyncio
import time

from cleave import bus as busmod
from cleave import codec
from cleave.schemas import RoundTask, RoundUpdate, SplitReply, SplitTask
from cleave_worker.device import DeviceState
from cleave_worker.local_rounds import RoundRunner
from cleave_worker.split_client import SplitRunner


class Methods:
    def __init__(self, device: DeviceState, bus: busmod.Bus) -> None:
        self.device, self.s, self.bus, self.log = device, device.s, bus, device.log
        self.rounds = RoundRunner(self.s.worker_id, self.s.data)
        self.split = SplitRunner(self.s.worker_id, str(self.s.data) if self.s.data else None)

    async def on_round(self, task: RoundTask, nbytes: int) -> None:
        """A data-parallel round (diloco, fedavg): train locally off the event loop, send the update."""
        self.device.faults.hit("round", task.round)
        arrived = time.time()
        try:
            with self.device.busy():
                update = await asyncio.to_thread(self.rounds.run, task)
        except Exception as e:  # a bad task spoils this round's update, not the worker
            self.log.warning("round_failed", job=task.job, round=task.round, error=repr(e))
            update = RoundUpdate(job=task.job, epoch=task.epoch, round=task.round, worker_id=self.s.worker_id,
                                 error=repr(e)[:500])
        else:
            if self.device.pacer is not None:  # behave like the declared device: answer when it would have
                up = len(await asyncio.to_thread(codec.encode, update))
                done = self.device.pacer.finish_at(arrived, nbytes, up, self.rounds.flops(task))
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
            reply = await asyncio.to_thread(self.split.run, task)
        except Exception as e:  # the PS hears why, and the step is not half-applied silently
            self.log.warning("split_step_failed", job=task.job, step=task.step, phase=task.phase, error=repr(e))
            reply = SplitReply(job=task.job, epoch=task.epoch, step=task.step, phase=task.phase,
                               worker_id=self.s.worker_id, error=repr(e)[:500])
        await self.bus.publish(task.reply, reply)
