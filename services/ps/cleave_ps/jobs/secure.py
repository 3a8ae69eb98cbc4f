"""The PS's side of one round of secure aggregation (`cleave.methods.secagg`): it relays, collects and unmasks.

The round's task names a fresh session; each member answers with its public keys at once, before it trains.
Then, each phase waiting until every member still in it answered (one that leaves the plan, fails or is late
past the round's deadline is left behind, and is a recovery event like any lost worker):
- keys (U1) -> every member of U1 gets the round's keys and the threshold (a majority of U1, at least 2);
- shares (U2) -> each member of U2 gets the ciphertexts the others addressed to it, and U2;
- masked inputs (U3) -> each member of U3 learns who survived and who dropped (U2 minus U3);
- reveals: with `threshold` of them the PS removes the masks and holds the sum of U3's updates, nothing else.
A phase that ends with fewer members than it needs ends the round with nothing accepted (it runs again with
a new session). Every message is checked against the phase and the session; anything else is refused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import numpy as np
import structlog
import torch

from cleave import codec
from cleave.bus import Bus
from cleave.errors import WireError
from cleave.methods import secagg
from cleave.schemas import SUBJECT_SECAGG, Event, RoundUpdate, SecAggKeys, SecAggTask
from cleave.train.job import JobConfig
from cleave_ps.fleet.plans import PlanWatch, first_of

log = structlog.get_logger("ps")
MAX_CIPHERTEXT = 2 * secagg.SHARE_BYTES + secagg.NONCE_BYTES + 16  # two shares, the nonce and GCM's tag


class Host(Protocol):
    """What a secure round uses of the rounds driver that runs it (`cleave_ps.jobs.rounds.Rounds`)."""

    job: JobConfig
    epoch: int
    bus: Bus
    plan: PlanWatch
    news: asyncio.Event  # set by every accepted message and plan change
    stop: asyncio.Event
    failed: dict[str, str]  # members that answered the round with an error
    server: object  # its `params`: the trainable tensors, by name

    def lost(self, r: int, worker: str, cause: str, t0: float, at: float | None = None) -> Event: ...


def threshold_for(members: int) -> int:
    """Shares needed to recover a secret: a majority of the members who sent keys, and at least 2."""
    return max(secagg.MIN_THRESHOLD, members // 2 + 1)


class SecureRound:
    def __init__(self, rounds: Host, r: int, session: str) -> None:
        self.rounds, self.r, self.session = rounds, r, session
        job = rounds.job
        self.context = f"{job.job_id}|{rounds.epoch}|{r}|{session}"
        self.shapes = {k: tuple(v.shape) for k, v in rounds.server.params.items()}
        self.phase = "keys"
        self.threshold = 0
        self.keys: dict[str, tuple[bytes, bytes]] = {}
        self.sealed: dict[str, dict[str, bytes]] = {}
        self.masked: dict[str, dict[str, np.ndarray]] = {}
        self.reveals: dict[str, tuple[dict[str, bytes], dict[str, bytes]]] = {}
        self.u2: tuple[str, ...] = ()
        self.u3: tuple[str, ...] = ()
        self.dropped: tuple[str, ...] = ()
        self.bytes_down = 0
        self.bytes_to: dict[str, int] = {}  # member -> bytes of its own messages

    def on_update(self, msg: RoundUpdate) -> str | None:
        """Take a member's phase message; the reason it is refused, or None."""
        sa, w = msg.secagg, msg.worker_id
        if sa is None or sa.session != self.session:
            return "secagg_session"
        if sa.phase != self.phase:
            return "secagg_phase"
        if sa.phase == "keys":
            if sa.keys is None or w in self.keys:
                return "secagg_keys"
            self.keys[w] = (sa.keys.c_pk, sa.keys.s_pk)
        elif sa.phase == "shares":
            if w not in self.keys or w in self.sealed or set(sa.ciphertexts) != set(self.keys) - {w} or any(
                    len(c) > MAX_CIPHERTEXT for c in sa.ciphertexts.values()):
                return "secagg_shares"
            self.sealed[w] = dict(sa.ciphertexts)
        elif sa.phase == "masked":
            masked = self._masked(msg) if w in self.u2 and w not in self.masked else None
            if masked is None:
                return "secagg_masked"
            self.masked[w] = masked
        else:
            if w not in self.u3 or w in self.reveals or set(sa.b_shares) != set(self.u3) or set(sa.s_shares) != set(
                    self.dropped):
                return "secagg_reveal"
            self.reveals[w] = (dict(sa.b_shares), dict(sa.s_shares))
        self.rounds.news.set()
        return None

    def _masked(self, msg: RoundUpdate) -> dict[str, np.ndarray] | None:
        """The masked update as uint64 arrays of the trainable shapes, or None."""
        if msg.delta is None or set(msg.delta.tensors) != set(self.shapes):
            return None
        out = {}
        for k, p in msg.delta.tensors.items():
            if p.kind != "none" or p.values.dtype != "int64" or tuple(p.values.shape) != self.shapes[k]:
                return None
            out[k] = codec.data_to_tensor(p.values).numpy().view(np.uint64)
        return out

    async def send(self, to: list[str], make) -> None:  # noqa: ANN001 - member -> SecAggTask
        for w in to:
            sent = await self.rounds.bus.publish(SUBJECT_SECAGG.format(worker_id=w), make(w))
            self.bytes_down += sent
            self.bytes_to[w] = self.bytes_to.get(w, 0) + sent

    def task(self, phase: str, **fields: object) -> SecAggTask:
        job = self.rounds.job
        return SecAggTask(job=job.job_id, epoch=self.rounds.epoch, round=self.r, session=self.session, phase=phase,
                          **fields)

    async def gather(self, have: dict, waiting: set[str], deadline: float, t0: float, lost: list[Event]) -> set[str]:
        """Until every member of `waiting` still in the plan sent this phase's message, or the deadline."""
        rounds = self.rounds
        while not rounds.stop.is_set():
            rounds.news.clear()
            for w in sorted(waiting - set(have)):
                cause = ("left_plan" if w not in rounds.plan.workers else "update_failed" if w in rounds.failed
                         else None)
                if cause is not None:
                    lost.append(rounds.lost(self.r, w, cause, t0))
                    waiting = waiting - {w}
            if waiting <= set(have) or time.monotonic() >= deadline:
                break
            await first_of(rounds.news, rounds.stop, timeout_s=max(0.0, deadline - time.monotonic()))
        late = sorted(waiting - set(have))
        if late and not rounds.stop.is_set():
            log.warning("secagg_phase_timed_out", round=self.r, phase=self.phase, missing=late)
            lost += [rounds.lost(self.r, w, "round_timeout", t0) for w in late]
        return waiting & set(have)

    async def run(self, expected: set[str], t0: float) -> tuple[dict[str, torch.Tensor] | None, tuple[str, ...],
                                                                 list[Event], str | None]:
        """The round's phases; the sum of the survivors' updates, the survivors, the losses, or why none."""
        lost: list[Event] = []
        deadline = time.monotonic() + self.rounds.job.round_timeout_s
        u1 = await self.gather(self.keys, set(expected), deadline, t0, lost)
        if len(u1) < secagg.MIN_THRESHOLD:
            return None, (), lost, f"{len(u1)} members sent keys; secure aggregation needs at least 2"
        self.threshold = threshold_for(len(u1))
        self.keys = {w: self.keys[w] for w in u1}
        keys = {w: SecAggKeys(c_pk=c, s_pk=s) for w, (c, s) in self.keys.items()}
        self.phase = "shares"
        await self.send(sorted(u1), lambda w: self.task("share", threshold=self.threshold, keys=keys))
        u2 = await self.gather(self.sealed, u1, deadline, t0, lost)
        if len(u2) < self.threshold:
            return None, (), lost, f"{len(u2)} members sent their shares, {self.threshold} needed"
        self.u2, self.phase = tuple(sorted(u2)), "masked"
        await self.send(list(self.u2), lambda v: self.task(
            "mask", members=self.u2, ciphertexts={u: self.sealed[u][v] for u in self.u2 if u != v}))
        u3 = await self.gather(self.masked, u2, deadline, t0, lost)
        if len(u3) < self.threshold:
            return None, (), lost, f"{len(u3)} masked updates arrived, {self.threshold} needed to unmask"
        self.u3, self.dropped, self.phase = tuple(sorted(u3)), tuple(sorted(u2 - u3)), "reveal"
        await self.send(list(self.u3), lambda v: self.task("reveal", members=self.u3, dropped=self.dropped))
        revealed = await self.gather(self.reveals, u3, deadline, t0, lost)
        if len(revealed) < self.threshold:
            return None, (), lost, f"{len(revealed)} members revealed their shares, {self.threshold} needed"
        try:
            total = await asyncio.to_thread(secagg.unmask, self.context, self.keys, self.threshold,
                                            {u: self.masked[u] for u in self.u3}, self.dropped,
                                            {w: self.reveals[w] for w in revealed})
        except WireError as e:
            return None, (), lost, f"the masks could not be removed: {e}"
        log.info("secagg_unmasked", round=self.r, session=self.session, members=len(u1), survivors=len(self.u3),
                 dropped=list(self.dropped), threshold=self.threshold)
        return total, self.u3, lost, None
