"""Client-level differential privacy for FedAvg (DP-FedAvg, McMahan et al. 2018) and its accountant.

Every member's update is clipped to an L2 norm of at most C (`update_clip`: by the PS, and by the member
itself under secure aggregation), so adding or removing one member's data moves the sum of a round's
updates by at most C. The PS adds Gaussian noise of standard deviation z·C (`dp_noise` = z, the noise
multiplier) to that sum before it divides by the number of members (which is public): each round is a
Gaussian mechanism with sensitivity C and noise zC.

The accountant is exact for this setting (every member takes part in every round, no subsampling): T such
rounds compose into one Gaussian mechanism with μ = √T / z (Dong, Roth and Su 2019, Gaussian differential
privacy), whose (ε, δ) curve is the analytic Gaussian mechanism's (Balle and Wang 2018):
δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2). `epsilon` inverts it by bisection. The PS reports, with every round,
the ε spent so far at the job's δ (`dp_delta`), counting every round up to it as a release (a restarted PS
counts from its committed round on, never fewer).

The noise comes from a generator seeded by the operating system, never from the job's seed (which the
workers know): a DP run is not bit-reproducible, by design.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

from cleave.methods.common import State
from cleave.schemas import MAX_EPSILON  # the bisection's upper end; a run past it reports this bound


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def delta_of(eps: float, mu: float) -> float:
    """The δ of a μ-GDP mechanism at ε (the analytic Gaussian mechanism's curve)."""
    if mu <= 0:
        return 0.0
    tail = math.exp(eps + math.log(_phi(-eps / mu - mu / 2))) if _phi(-eps / mu - mu / 2) > 0 else 0.0
    return max(0.0, _phi(-eps / mu + mu / 2) - tail)


def epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """The ε spent after `rounds` full-participation rounds of the Gaussian mechanism with noise multiplier z."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    mu = math.sqrt(rounds) / noise_multiplier
    lo, hi = 0.0, MAX_EPSILON
    if delta_of(hi, mu) > delta:
        return MAX_EPSILON
    for _ in range(200):
        mid = (lo + hi) / 2
        if delta_of(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def noise_like(state: Mapping[str, torch.Tensor], std: float) -> State:
    """Gaussian noise of standard deviation `std` for every tensor, from an OS-seeded generator."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    return {k: torch.randn(t.shape, generator=g, dtype=torch.float64).mul_(std).to(t.dtype) for k, t in state.items()}
