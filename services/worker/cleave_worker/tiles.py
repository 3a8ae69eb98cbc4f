"""The worker's tiles: fan-out groups joined and their blocks cached, link checks answered, each tile's inputs
resolved, computed off the event loop and its result uploaded from a task of its own."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from cleave import bus as busmod
from cleave.errors import WireError
from cleave.gemm.dealer import JOINS_KEPT
from cleave.schemas import (
    SUBJECT_FANOUT,
    BlockPush,
    FanoutAck,
    FanoutJoin,
    LinkCheck,
    LinkCheckAck,
    TileResult,
    TileTask,
)
from cleave_worker.core import BlockCache, check_inputs, compute, leaves, reply_to
from cleave_worker.device import DeviceState

INLINE_S = 1e-3  # a CPU tile this quick (at the rate this worker's tiles last computed at) is multiplied on the
# event loop: handing it to a thread and back costs as much again, and on busy cores the wake-ups cost more

DEFAULT_FANOUT_WAIT_S = 2.0  # how long a tile waits for a block its fan-out group is being sent


class Tiles:
    def __init__(self, device: DeviceState, bus: busmod.Bus) -> None:
        self.device, self.s, self.bus = device, device.s, bus
        self.log = device.log
        self.cache = BlockCache(self.s.cache_bytes)
        self.epochs: dict[str, int] = {}  # job -> newest PS epoch seen; older PSs are fenced off
        self.groups: dict[str, object] = {}  # fan-out subject -> its subscription
        self.joins: dict[str, deque[tuple[str, ...]]] = {}  # job -> subjects of its latest joins (JOINS_KEPT)
        self.arrivals: dict[str, asyncio.Event] = {}  # fan-out blocks a tile waits for
        self.fenced_before: dict[str, tuple[int, float]] = {}  # job -> (epoch, PS time) of its last link check
        self.stale = 0  # tiles dropped because they were sent before this worker's last link check
        self.outbox: asyncio.Queue = asyncio.Queue()  # (task, result, due) to upload; None: stop
        self.flops_per_s = device.profile.flops  # what its last tile computed at (at first: its profile's)

    async def on_join(self, join: FanoutJoin) -> FanoutAck:
        """The PS's fan-out groups for this worker: subscribe to them, leave the job's others."""
        if join.epoch < self.epochs.get(join.job, 0):
            return FanoutAck(worker_id=self.s.worker_id, error=f"epoch {join.epoch} is fenced off")
        self.epochs[join.job] = join.epoch
        prefix = SUBJECT_FANOUT.split("{epoch}")[0].format(job=join.job)  # this job's fan-out subjects
        joins = self.joins.setdefault(join.job, deque(maxlen=JOINS_KEPT))
        joins.append(join.subjects)
        keep = set().union(*joins)  # a GEMM in flight when the plan changed goes on with its groups
        try:
            for subject in [s for s in self.groups if s.startswith(prefix) and s not in keep]:
                await self.groups.pop(subject).unsubscribe()
            for subject in join.subjects:
                if subject not in self.groups:
                    self.groups[subject] = await self.bus.subscribe(subject, BlockPush, self.on_push)
            await self.bus.nc.flush(timeout=busmod.DEFAULT_TIMEOUT_S)  # subscribed at the server before we say so
        except Exception as e:  # the PS then sends this worker's shared blocks with its tiles
            return FanoutAck(worker_id=self.s.worker_id, error=repr(e)[:500])
        return FanoutAck(worker_id=self.s.worker_id, joined=tuple(s for s in join.subjects if s in self.groups))

    async def on_check(self, check: LinkCheck) -> LinkCheckAck:
        """The PS proves this worker's downlink (it came back) before dealing it tiles: answer at once."""
        if check.job and check.epoch >= self.epochs.get(check.job, 0):
            self.fenced_before[check.job] = (check.epoch, check.sent_at)
        return LinkCheckAck(worker_id=self.s.worker_id)

    async def on_push(self, push: BlockPush, nbytes: int) -> None:
        """A shared input block published to one of this worker's groups: cache it for the tiles that need it."""
        if push.epoch < self.epochs.get(push.job, 0) or push.block.tensor is None:
            return
        self.cache.resolve(push.block)
        waiting = self.arrivals.pop(push.block.id, None)
        if waiting is not None:
            waiting.set()

    async def _arrived(self, ref) -> None:  # noqa: ANN001
        """Wait (a little) for a block that comes on a fan-out subject and is not here yet."""
        if not ref.fanout or ref.tensor is not None or self.cache.get(ref.id) is not None:
            return
        event = self.arrivals.setdefault(ref.id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), DEFAULT_FANOUT_WAIT_S)
        except TimeoutError:
            self.arrivals.pop(ref.id, None)  # the tile answers that it is missing; the PS sends it direct

    async def on_tile(self, task: TileTask, nbytes: int) -> None:
        self.device.faults.hit("tile", task.step)
        if task.epoch < self.epochs.get(task.job, 0):
            self.log.warning("tile_fenced", job=task.job, epoch=task.epoch, newest=self.epochs[task.job])
            return
        self.epochs[task.job] = task.epoch
        fence = self.fenced_before.get(task.job)
        if fence is not None and fence[0] == task.epoch and task.sent_at < fence[1]:
            self.stale += 1  # sent before this worker left; the PS gave it to another worker then
            self.log.debug("tile_stale", step=task.step, op=task.op, tile=task.tile, dropped=self.stale)
            return
        refs = (*leaves(task.a), *leaves(task.b))
        await asyncio.gather(*(self._arrived(ref) for ref in refs))
        a, bt = self.cache.resolve(task.a), self.cache.resolve(task.b)
        missing = tuple(leaf.id for ref, t in ((task.a, a), (task.b, bt)) if t is None for leaf in leaves(ref)
                        if leaf.tensor is None and self.cache.get(leaf.id) is None)
        flops = 0.0  # of the product, where it is computed
        if missing:
            result = reply_to(task, self.s.worker_id, missing=missing)
        elif why := check_inputs(a, bt, self.device.profile.memory_bytes):
            self.log.warning("tile_refused", reason=why, step=task.step, op=task.op, tile=task.tile)
            result = reply_to(task, self.s.worker_id, error=why)
        else:
            flops = 2 * a.shape[0] * bt.shape[0] * a.shape[1]
            with self.device.busy():
                if flops <= INLINE_S * self.flops_per_s and a.device.type == "cpu":
                    result = compute(task, a, bt, self.s.worker_id, self.s.corrupt)
                else:
                    result = await asyncio.to_thread(compute, task, a, bt, self.s.worker_id, self.s.corrupt)
            if flops and result.compute_s > 0:
                self.flops_per_s = flops / result.compute_s
            self.device.tiles_done += 1
            self.device.busy_s += result.compute_s
        due = 0.0
        pacer = self.device.pacer
        if pacer is not None and result.out is not None:  # behave like the declared device: answer when
            # it would have (its uplink is the uploader's)
            due = pacer.finish_at(min(task.sent_at, time.time()), nbytes, len(result.out.data), flops)
        self.outbox.put_nowait((task, result, due))  # uploaded by `uploads` while the next tile computes

    async def uploads(self) -> None:
        """Send results in the order they were computed, from a task of their own: a result waiting for a
        slow uplink never holds up the next tile's compute (the streamed device of the cost model)."""
        while (item := await self.outbox.get()) is not None:  # None: stopping, what was queued before is sent
            await self._upload(*item)
            del item  # sent: its blocks and result are not held while the next result is awaited

    async def _upload(self, task: TileTask, result: TileResult, due: float) -> None:
        if due:
            await asyncio.sleep(max(0.0, due - time.time()))
        try:
            await self.bus.publish(task.reply, result, compress=False)  # dense floats: the PS refuses zstd
        except WireError as e:  # e.g. an output block over the limits: say so, the PS gives the tile away
            self.log.warning("result_not_sent", error=str(e), step=task.step, op=task.op, tile=task.tile)
        except Exception as e:  # disconnected: the PS's deadline gives the tile to another worker
            self.log.warning("result_not_sent", error=repr(e), step=task.step, op=task.op, tile=task.tile)

    async def close_outbox(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.outbox.put_nowait(None)
