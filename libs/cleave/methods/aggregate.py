"""Rounds and aggregation shared by DiLoCo and FedAvg: who sent what for which round, and how it is combined.

The round rule (one place, both methods):
- A round is numbered; the PS hands out the global weights of round r, senders train and return an update
  tagged with r. The PS closes the round when every expected sender reported or its deadline passed
  (that decision is the service's: `RoundCollector.complete(expected)` helps). Whoever did not report
  (a straggler or a leaver) simply does not count in this round.
- A *late* update (tagged r' < r) is dropped when `r - r' > max_staleness` (the default, 0, drops every
  late update); otherwise it is folded into the current round with its weight scaled by 1 / (1 + r - r').
- A second update from the same sender for the same round, one for a future round, or one whose names,
  shapes or values are wrong (non-finite) is dropped and counted; it never raises.
- A round that closes with fewer than `min_updates` updates applies nothing and the global weights stay; one
  that closes with no accepted update at all is not a round: its number stays, to be run again.
- The senders' weights are the service's to give (the tokens it dealt each one), never what a sender claims;
  `clip_update` bounds the L2 norm of one update before it counts.

Aggregation rules: `mean` (weighted by each update's weight: samples or tokens), `median` (coordinate-wise)
and `trimmed` (coordinate-wise, the `trim` fraction dropped at each end). The robust rules ignore the
weights on purpose: a malicious sender could claim any sample count.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from cleave.errors import ConfigError, WireError
from cleave.methods.common import State, check_state

Rule = Literal["mean", "median", "trimmed"]
Verdict = Literal["accepted", "late", "duplicate", "future", "rejected"]
RULES = ("mean", "median", "trimmed")
DEFAULT_TRIM = 0.2  # trimmed mean: drop this fraction of values at each end, per coordinate


@dataclass(frozen=True)
class Update:
    sender: str
    round: int  # the round whose global weights the sender started from
    delta: State
    weight: float  # samples or tokens behind the update, times the staleness factor


@dataclass
class RoundReport:
    """What closing a round did; the service turns it into metrics and events."""

    round: int
    applied: bool
    senders: tuple[str, ...]
    late_folded: int = 0  # accepted updates from earlier rounds
    counts: dict[str, int] = field(default_factory=dict)  # verdicts seen during the round
    update_norm: float = 0.0  # L2 norm of the aggregated update


def staleness_weight(staleness: int) -> float:
    return 1.0 / (1 + staleness)


def _stack(deltas: Sequence[State], name: str) -> torch.Tensor:
    return torch.stack([d[name].float().reshape(-1) for d in deltas])  # (senders, numel)


def _median(x: torch.Tensor) -> torch.Tensor:
    s = x.sort(dim=0).values  # (senders, numel)
    n = s.shape[0]
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2  # mean of the two middles when even


def trim_cut(n: int, trim: float) -> int:
    """How many of `n` values the trimmed mean drops at each end (0 below 1 / trim: it is the plain mean)."""
    cut = math.floor(trim * n)
    return (n - 1) // 2 if n - 2 * cut < 1 else cut


def _trimmed(x: torch.Tensor, trim: float) -> torch.Tensor:
    n = x.shape[0]
    cut = trim_cut(n, trim)
    return x.sort(dim=0).values[cut : n - cut].mean(dim=0)


def aggregate(
    deltas: Sequence[State], weights: Sequence[float], rule: Rule = "mean", trim: float = DEFAULT_TRIM
) -> State:
    """Combine updates name by name: weighted mean, coordinate-wise median or trimmed mean."""
    if not deltas:
        raise ValueError("nothing to aggregate")
    if rule not in RULES:
        raise ConfigError(f"aggregation={rule!r} is not one of {', '.join(RULES)}")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if rule == "mean" and (len(w) != len(deltas) or bool((w < 0).any()) or float(w.sum()) <= 0):
        raise ValueError(
            f"mean aggregation needs one non-negative weight per update with a positive sum, got {weights}"
        )
    out = {}
    for name, ref in deltas[0].items():
        x = _stack(deltas, name)
        if rule == "mean":
            agg = (w.to(x.dtype)[:, None] / float(w.sum()) * x).sum(dim=0) if len(deltas) > 1 else x[0]
        elif rule == "median":
            agg = _median(x)
        else:
            agg = _trimmed(x, trim)
        out[name] = agg.reshape(ref.shape).to(ref.dtype)
    return out


def round_loss(losses: Sequence[float], rule: Rule, trim: float = DEFAULT_TRIM) -> float:
    """The loss a round reports: the first local losses its senders claim, combined as the round combines their
    updates (the mean, unweighted; a median or trimmed round's loss is not whatever one sender claims), those
    not finite left out (a sender whose loss was not finite failed its round: one that claims one lies); NaN
    when there are none."""
    xs = [v for v in losses if math.isfinite(v)]
    if not xs or rule == "mean":
        return statistics.fmean(xs) if xs else math.nan
    x = torch.tensor(xs, dtype=torch.float64)[:, None]
    return float(_median(x) if rule == "median" else _trimmed(x, trim))


class RoundCollector:
    """Collects the updates of the round in flight under the round rule above."""

    def __init__(
        self, reference: Mapping[str, torch.Tensor], max_staleness: int = 0, start_round: int = 0
    ) -> None:
        self.shapes = {k: torch.empty(tuple(v.shape), device="meta") for k, v in reference.items()}
        self.max_staleness = max_staleness
        self.round = start_round
        self._updates: dict[tuple[str, int], Update] = {}
        self.counts: dict[str, int] = {}

    def submit(self, sender: str, round: int, delta: Mapping[str, torch.Tensor], weight: float) -> Verdict:
        verdict = self._judge(sender, round, delta, weight)
        self.counts[verdict] = self.counts.get(verdict, 0) + 1
        if verdict == "accepted":
            w = weight * staleness_weight(self.round - round)
            self._updates[(sender, round)] = Update(sender, round, dict(delta), w)
        return verdict

    def _judge(self, sender: str, round: int, delta: Mapping[str, torch.Tensor], weight: float) -> Verdict:
        if round > self.round:
            return "future"
        if self.round - round > self.max_staleness:
            return "late"
        if (sender, round) in self._updates:
            return "duplicate"
        if not (math.isfinite(weight) and weight >= 0):
            return "rejected"
        try:
            check_state(self.shapes, delta)
        except WireError:
            return "rejected"
        return "accepted"

    def senders(self) -> set[str]:
        return {s for s, r in self._updates if r == self.round}

    def complete(self, expected: set[str]) -> bool:
        """Every expected sender has reported for the current round."""
        return expected <= self.senders()

    def close(self) -> tuple[list[Update], dict[str, int]]:
        """The accepted updates and the verdict counts of this round; the next round begins, unless nothing was
        accepted (then the same round number runs again)."""
        updates, counts = list(self._updates.values()), self.counts
        self._updates, self.counts = {}, {}
        if updates:
            self.round += 1
        return updates, counts


def norm(state: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of a set of tensors taken as one vector."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in state.values()))


def clip_update(delta: Mapping[str, torch.Tensor], max_norm: float) -> tuple[State, float]:
    """`delta` scaled to an L2 norm of at most `max_norm` (as a whole, not per tensor), and its norm before."""
    n = norm(delta)
    if max_norm <= 0 or n <= max_norm:
        return dict(delta), n
    scale = max_norm / n
    return {k: (t.double() * scale).to(t.dtype) for k, t in delta.items()}, n


def close_and_aggregate(
    collector: RoundCollector, min_updates: int, rule: Rule, trim: float
) -> tuple[RoundReport, State | None]:
    """Close the collector's round; the aggregate of its updates, or None under `min_updates`."""
    r = collector.round
    updates, counts = collector.close()
    senders = tuple(sorted(u.sender for u in updates))
    late = sum(1 for u in updates if u.round < r)
    if len(updates) < min_updates:
        return RoundReport(r, False, senders, late, counts), None
    agg = aggregate([u.delta for u in updates], [u.weight for u in updates], rule, trim)
    return RoundReport(r, True, senders, late, counts, norm(agg)), agg
