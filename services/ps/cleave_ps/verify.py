"""Verification of workers (pure): a sampled fraction of tiles is computed by a second worker.

When the two blocks disagree beyond float tolerance, the PS computes the block itself to tell which worker
lied; that worker is excluded and the step is redone without it (its earlier blocks may be wrong too).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5


@dataclass
class Check:
    tile: int
    attempt: int  # the verifying attempt
    first_worker: str
    verifier: str
    block: torch.Tensor  # the first worker's block


class Verifier:
    def __init__(self, fraction: float, seed: int = 0) -> None:
        self.fraction = fraction
        self.rng = random.Random(seed)
        self.checks: dict[int, Check] = {}  # tile -> pending check, for the GEMM in flight
        self.done = self.mismatches = 0

    def sample(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    def new_gemm(self) -> None:
        self.checks.clear()

    @staticmethod
    def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
        scale = max(float(a.abs().max()), float(b.abs().max()), 1.0)
        return bool(torch.allclose(a, b, rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL * scale))

    def judge(self, check: Check, second: torch.Tensor, truth: torch.Tensor) -> str | None:
        """The worker whose block is wrong (checked against the PS's own product), or None if both agree."""
        self.done += 1
        if self.agree(check.block, second):
            return None
        self.mismatches += 1
        return check.verifier if self.agree(check.block, truth) else check.first_worker
