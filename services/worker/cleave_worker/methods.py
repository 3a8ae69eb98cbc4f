"""The worker's rounds (DiLoCo, FedAvg: train locally, send the update) and its half of split learning, each
run off the event loop; a failure spoils that round's or step's answer, never the worker. The job's base
weights and tokenizer are fetched from the PS's bundles first (once per job, cached by hash).

Under secure aggregation (a round task with a session) the member sends its public keys at once, trains,
clips its update to the job's `update_clip`, and sends it masked (`cleave.methods.secagg`) once the PS has
told it the round's members; the PS's phase messages (`on_secagg`) are answered as they come."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cleave import bus as busmod
from cleave import codec
from cleave.compression import unpack
from cleave.errors import JobRefused, WireError
from cleave.methods import secagg
from cleave.methods.aggregate import clip_update
from cleave.models.bundles import BundleCache
from cleave.schemas import (
    Packed,
    PackedTensors,
    RoundTask,
    RoundUpdate,
    SecAggKeys,
    SecAggReply,
    SecAggTask,
    SplitReply,
    SplitTask,
)
from cleave_worker.device import DeviceState
from cleave_worker.local_rounds import RoundRunner, private
from cleave_worker.split_client import SplitRunner

MAX_SESSIONS = 4  # secure-aggregation rounds remembered at once


@dataclass
class Session:
    """This member's side of one secure-aggregation round."""

    member: secagg.SecureMember
    reply: str  # its update subject
    base: dict  # job, epoch, round, worker_id of its updates
    members_known: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: bool = False  # the PS dealt the job a new session: it gave this one up


def masked_update(y: dict) -> PackedTensors:
    """A masked update (uint64 fixed point) as int64 tensors, which the codec carries bit for bit."""
    return PackedTensors(tensors={k: Packed(kind="none", dtype="int64", shape=v.shape,
                                            values=codec.tensor_to_data(torch.from_numpy(v.view("int64"))))
                                  for k, v in y.items()})


class Methods:
    def __init__(self, device: DeviceState, bus: busmod.Bus) -> None:
        self.device, self.s, self.bus, self.log = device, device.s, bus, device.log
        self.rounds = RoundRunner(self.s.worker_id, self.s.data, self.s.round_memory_bytes, self.s.lie_weight)
        self.split = SplitRunner(self.s.worker_id, self.s.data)
        self.bundles = BundleCache(self.s.model_cache, self.s.worker_id)
        self.sessions: dict[str, Session] = {}
        self.waiting: set[asyncio.Task] = set()  # masked updates waiting for their round's members

    async def fetch(self, bundle_id: str) -> Path | None:
        """The local directory of a published bundle ("" : none)."""
        return await self.bundles.fetch(self.bus, bundle_id) if bundle_id else None

    async def on_round(self, task: RoundTask, nbytes: int) -> None:
        """A data-parallel round (diloco, fedavg): train locally off the event loop, send the update."""
        self.device.faults.hit("round", task.round)
        arrived = time.time()
        reply = task.reply.replace("{worker_id}", self.s.worker_id)  # its own subject
        session = await self.open_session(task, reply) if task.session else None
        try:
            base, tok = await self.fetch(task.base_bundle), await self.fetch(task.tokenizer_bundle)
            with self.device.busy():
                update = await asyncio.to_thread(self.rounds.run, task, base, tok)
        except Exception as e:  # a bad task spoils this round's update, not the worker
            update = self.failed(task, e)
        else:
            if self.device.pacer is not None:  # behave like the declared device: answer when it would have
                up = len(await asyncio.to_thread(codec.encode, update))
                done = self.device.pacer.finish_at(arrived, nbytes, up, self.rounds.flops(task, base, tok))
                await asyncio.sleep(max(0.0, done - time.time()))
            if session is not None:  # its wait for the members must not hold up the next round's task
                waits = asyncio.get_running_loop().create_task(self.send_masked(task, session, update, reply))
                self.waiting.add(waits)
                waits.add_done_callback(self.waiting.discard)
                return
        await self.bus.publish(reply, update)

    async def send_masked(self, task: RoundTask, session: Session, update: RoundUpdate, reply: str) -> None:
        try:
            masked = await self.masked(task, session, update)
        except Exception as e:  # an update it cannot mask: the round goes on without it, as without a dropout
            masked = self.failed(task, e)
        if masked is not None:
            await self.bus.publish(reply, masked)

    def failed(self, task: RoundTask, e: Exception) -> RoundUpdate:
        """What this worker answers a round it could not do (`refused`: nor any round of its job), logged here
        in full, sent with its data path left out."""
        refused = isinstance(e, JobRefused)
        said = str(e) if refused else repr(e)
        self.log.warning("round_refused" if refused else "round_failed", job=task.job, round=task.round, error=said)
        return RoundUpdate(job=task.job, epoch=task.epoch, round=task.round, worker_id=self.s.worker_id,
                           error=private(said, self.s.data)[:500], refused=refused)

    async def open_session(self, task: RoundTask, reply: str) -> Session:
        """Secure aggregation: fresh keys for this round's session, their public halves sent at once."""
        for old in self.sessions.values():  # one session of a job at a time: a new one means the PS gave up the old
            if old.base["job"] == task.job and not old.abandoned:
                old.abandoned = True
                old.members_known.set()
        member = secagg.SecureMember(self.s.worker_id, f"{task.job}|{task.epoch}|{task.round}|{task.session}")
        base = dict(job=task.job, epoch=task.epoch, round=task.round, worker_id=self.s.worker_id)
        session = self.sessions[task.session] = Session(member, reply, base)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.pop(next(iter(self.sessions)))
        c_pk, s_pk = member.public()
        await self.bus.publish(reply, RoundUpdate(**base, secagg=SecAggReply(
            session=task.session, phase="keys", keys=SecAggKeys(c_pk=c_pk, s_pk=s_pk))))
        return session

    async def masked(self, task: RoundTask, session: Session, update: RoundUpdate) -> RoundUpdate | None:
        """The update clipped and masked, once the PS named the round's members (None: it never did)."""
        job = json.loads(task.job_config)
        delta = await asyncio.to_thread(unpack, update.delta)
        if job.get("update_clip", 0) > 0:  # the PS cannot clip what it cannot see: the member does
            delta, _ = await asyncio.to_thread(clip_update, delta, job["update_clip"])
        try:
            await asyncio.wait_for(session.members_known.wait(), job.get("round_timeout_s", 120.0))
        except TimeoutError:
            self.log.warning("secagg_members_never_came", job=task.job, round=task.round, session=task.session)
            return None
        if session.abandoned:
            self.log.info("secagg_session_given_up", job=task.job, round=task.round, session=task.session)
            return None
        self.device.faults.hit("secagg_masked", task.round)
        y = await asyncio.to_thread(session.member.mask, delta)
        return update.model_copy(update={"delta": masked_update(y), "secagg": SecAggReply(
            session=task.session, phase="masked")})

    async def on_secagg(self, task: SecAggTask, nbytes: int) -> None:
        """A phase of secure aggregation from the PS: send the shares, learn the members, or reveal."""
        session = self.sessions.get(task.session)
        if session is None or task.job != session.base["job"] or task.round != session.base["round"]:
            self.bus.reject("secagg_session", f"secagg {task.phase} for round {task.round}", task.session)
            return
        m = session.member
        try:
            if task.phase == "share":
                keys = {u: (k.c_pk, k.s_pk) for u, k in task.keys.items()}
                sealed = await asyncio.to_thread(m.share, keys, task.threshold)
                out = SecAggReply(session=task.session, phase="shares", ciphertexts=sealed)
            elif task.phase == "mask":
                await asyncio.to_thread(m.receive, task.ciphertexts, task.members)
                session.members_known.set()
                return
            else:
                b, s = m.reveal(task.members, task.dropped)
                out = SecAggReply(session=task.session, phase="reveal", b_shares=b, s_shares=s)
        except WireError as e:  # a PS asking what the protocol forbids gets nothing
            self.bus.reject(e.reason, f"secagg {task.phase} for round {task.round}", str(e))
            return
        await self.bus.publish(session.reply, RoundUpdate(**session.base, secagg=out))

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
                               worker_id=self.s.worker_id, error=private(repr(e), self.s.data)[:500])
        await self.bus.publish(task.reply, reply)
