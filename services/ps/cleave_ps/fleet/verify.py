"""The optional cross-worker check of results (`verify_fraction`): a sampled tile is computed again by a second
worker, picked at random among the live ones (no worker can tell whether, or by whom, its tile is checked).

When the two blocks disagree beyond float tolerance, the PS computes the block itself to tell which worker
lied; that worker is excluded and the step is redone without it. Every check is judged: when the verifier does
not deliver a usable block (it answers an error or a cache miss, its block is refused, it is lost or
excluded), the PS judges the first block against its own product instead. (Every result is also checked on
its own, by Freivalds' check: `cleave_ps.fleet.freivalds`; this is the stricter, element by element one.)
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from typing import Protocol

import torch

from cleave.gemm import tiles
from cleave.gemm.dealer import Dealer, Send
from cleave_ps.fleet.runs import Check, GemmRun

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5


class Verifier:
    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.rng = secrets.SystemRandom()  # unpredictable: which tiles are checked, and by whom
        self.done = self.mismatches = 0  # (the pending checks are each GEMM's: `GemmRun.checks`)
        self.alone = 0  # checks the PS judged alone (the verifier delivered no usable block)

    def sample(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    def pick(self, workers: Sequence[str]) -> str:
        return self.rng.choice(sorted(workers))

    @staticmethod
    def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal within float32 reordering, or within two rounding steps of a bf16/fp16 job's blocks."""
        rtol = max(DEFAULT_RTOL, 2 * max(torch.finfo(a.dtype).eps, torch.finfo(b.dtype).eps))
        a, b = a.float(), b.float()
        scale = max(float(a.abs().max()), float(b.abs().max()), 1.0)
        return bool(torch.allclose(a, b, rtol=rtol, atol=DEFAULT_ATOL * scale))

    def judge(self, check: Check, second: torch.Tensor | None, truth: torch.Tensor) -> str | None:
        """The worker whose block is wrong (checked against the PS's own product), or None if none is; without
        a `second` block, only the first is judged."""
        self.done += 1
        if second is None:
            self.alone += 1
            if self.agree(check.block, truth):
                return None
            self.mismatches += 1
            return check.first_worker
        if self.agree(check.block, second):
            return None
        self.mismatches += 1
        return check.verifier if self.agree(check.block, truth) else check.first_worker


class CheckShell(Protocol):
    """What the checks need of the dispatcher."""

    dealer: Dealer
    runs: dict[int, GemmRun]

    def clock(self) -> float: ...

    def live(self) -> list[str]: ...

    def expel(self, worker: str, run: GemmRun, tile: int, cause: str, spoil: bool) -> None: ...

    def maybe_done(self, run: GemmRun) -> None: ...

    def track(self, coro) -> None: ...  # noqa: ANN001


class CrossChecks:
    """The dispatcher's side of the cross-worker check: start one, judge one, judge those of a lost verifier."""

    def __init__(self, d: CheckShell, fraction: float) -> None:
        self.d, self.verifier = d, Verifier(fraction)

    def maybe(self, run: GemmRun, tile: int, first: str) -> list[Send]:
        """Sampled: have a random other live worker compute `tile` again; the comparison comes with its result."""
        if not self.verifier.sample():
            return []
        others = [w for w in self.d.live() if w != first]
        if not others:
            return []
        worker = self.verifier.pick(others)
        led = self.d.dealer.deal(run.seq).ledger
        t = led.tiles[tile]
        send = self.d.dealer.extra(tile, worker, self.d.clock(), run.seq)
        run.checks[tile] = Check(tile, send.attempt, first, worker, run.out[t.r0 : t.r1, t.c0 : t.c1].clone())
        return [send]

    async def settle(self, run: GemmRun, check: Check, second: torch.Tensor | None) -> None:
        """Judge `check` with the verifier's block, or (None) without it; a liar is excluded, the step redone."""
        if run.checks.get(check.tile) is not check:
            return  # judged already
        if second is not None and self.verifier.agree(check.block, second):  # no need for the PS's own product
            del run.checks[check.tile]
            self.verifier.done += 1
            self.d.maybe_done(run)
            return
        t = self.d.dealer.deal(run.seq).ledger.tiles[check.tile] if run.seq in self.d.runs else None
        if t is None:
            del run.checks[check.tile]
            return
        truth = await asyncio.to_thread(lambda: tiles.compute(run.a[t.r0 : t.r1].detach().float(),
                                                              run.bt[t.c0 : t.c1].detach().float()).to(run.out.dtype))
        run.checks.pop(check.tile, None)
        liar = self.verifier.judge(check, second, truth)
        if liar is not None and run.seq in self.d.runs:
            self.d.expel(liar, run, check.tile, "verification_mismatch", spoil=True)
        self.d.maybe_done(run)

    def vanished(self, worker: str) -> None:
        """`worker` is lost or excluded: the checks it owed are judged by the PS."""
        for run in list(self.d.runs.values()):
            for check in [c for c in run.checks.values() if c.verifier == worker]:
                self.d.track(self.settle(run, check, None))
