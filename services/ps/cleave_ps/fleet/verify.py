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
        self.done = self.mismatches = 0  # (the pending checks are each GEMM's: `GemmRun.checks`)

    def sample(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    @staticmethod
    def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal within float32 reordering, or within two rounding steps of a bf16/fp16 job's blocks."""
        rtol = max(DEFAULT_RTOL, 2 * max(torch.finfo(a.dtype).eps, torch.finfo(b.dtype).eps))
        a, b = a.float(), b.float()
        scale = max(float(a.abs().max()), float(b.abs().max()), 1.0)
        return bool(torch.allclose(a, b, rtol=rtol, atol=DEFAULT_ATOL * scale))

    def judge(self, check: Check, second: torch.Tensor, truth: torch.Tensor) -> str | None:
        """The worker whose block is wrong (checked against the PS's own product), or None if both agree."""
        self.done += 1
        if self.agree(check.block, second):
            return None
        self.mismatches += 1
        return check.verifier if self.agree(check.block, truth) else check.first_worker
