"""FedAvg (McMahan et al. 2017) with robust aggregation: private data stays on the client, deltas travel.

Per round r, with global trainable weights θ (the whole model, or only LoRA adapters, see `lora`):
- a client loads θ, takes E local steps on its own data and sends δ = θ_local - θ and its sample count;
- the server combines the δ that arrived (weighted mean by samples, coordinate-wise median, or trimmed
  mean; the round, late-update and leaver rules are those of `rounds`) and sets θ ← θ + lr_server · δ̄.

With one client, one local step and lr_server = 1, θ_next = θ_local: plain training.

Two privacy options (`cleave.methods.secagg`, `cleave.methods.privacy`): the sum of a round's deltas may come
from secure aggregation instead of the deltas themselves (`close_with_sum`: the mean is that sum over the
number of members), and with `dp_noise` > 0 Gaussian noise of std dp_noise x clip is added to the sum
before it is divided (client-level DP; the members' deltas are clipped to `clip`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from cleave.errors import ConfigError
from cleave.methods.aggregate import (
    DEFAULT_TRIM,
    RULES,
    RoundCollector,
    RoundReport,
    Rule,
    Verdict,
    close_and_aggregate,
)
from cleave.methods.common import Batch, State, load_into, snapshot, train_step, trainable
from cleave.methods.privacy import noise_like
from cleave.train.job import DEFAULT_LOCAL_STEPS as JOB_LOCAL_STEPS

DEFAULT_LOCAL_STEPS = JOB_LOCAL_STEPS  # E: the job's default


@dataclass(frozen=True)
class FedAvgConfig:
    local_steps: int = DEFAULT_LOCAL_STEPS
    server_lr: float = 1.0  # 1 = plain FedAvg: the new global weights are the aggregate of the clients'
    rule: Rule = "mean"
    trim: float = DEFAULT_TRIM
    max_staleness: int = 0  # synchronous by default: late deltas are dropped
    min_updates: int = 1
    dp_noise: float = 0.0  # > 0: Gaussian noise of std dp_noise * clip on each round's sum (client-level DP)
    clip: float = 0.0  # the L2 bound of one delta (the DP noise's sensitivity)

    def __post_init__(self) -> None:
        if self.local_steps < 1 or self.server_lr <= 0:
            raise ConfigError("local_steps must be >= 1 and server_lr positive")
        if self.rule not in RULES or not 0 <= self.trim < 0.5:
            raise ConfigError(f"rule must be one of {', '.join(RULES)} and trim in [0, 0.5)")
        if self.max_staleness < 0 or self.min_updates < 1:
            raise ConfigError("max_staleness must be >= 0 and min_updates >= 1")
        if self.dp_noise > 0 and (self.clip <= 0 or self.rule != "mean" or self.max_staleness):
            raise ConfigError("dp_noise needs clip > 0, rule 'mean' and max_staleness 0 (its noise is calibrated "
                              "to one clipped delta in an unweighted mean)")


@dataclass(frozen=True)
class ClientUpdate:
    delta: State  # θ_local - θ, trainable tensors only
    samples: int  # sequences trained on this round (the aggregation weight)
    losses: tuple[float, ...]


def client_update(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    global_state: Mapping[str, torch.Tensor],
    batches: Iterable[Batch],
    local_steps: int,
    grad_clip: float = 0.0,
    precision: str = "fp32",
) -> ClientUpdate:
    """A client's round: load θ into the trainable parameters, E local steps, return δ and the sample count."""
    params = trainable(model)
    load_into(params, global_state)
    losses, samples = [], 0
    for batch in batches:
        if len(losses) == local_steps:
            break
        losses.append(train_step(model, opt, batch, grad_clip, precision))
        samples += int(batch[0].shape[0])
    if len(losses) < local_steps:
        raise ValueError(f"client_update needs {local_steps} batches, got {len(losses)}")
    delta = {k: (p.detach() - global_state[k]).float() for k, p in params.items()}
    return ClientUpdate(delta, samples, tuple(losses))


class FedAvgServer:
    """The server side: global trainable parameters (owned by the caller's model) and the round."""

    def __init__(self, params: Mapping[str, nn.Parameter], cfg: FedAvgConfig, start_round: int = 0) -> None:
        self.cfg, self.params = cfg, dict(params)
        self.collector = RoundCollector(self.params, cfg.max_staleness, start_round)

    @property
    def round(self) -> int:
        return self.collector.round

    def global_state(self) -> State:
        return snapshot(self.params)

    def submit(self, sender: str, round: int, delta: Mapping[str, torch.Tensor], samples: float) -> Verdict:
        return self.collector.submit(sender, round, delta, samples)

    @torch.no_grad()
    def close_round(self) -> RoundReport:
        report, d = close_and_aggregate(self.collector, self.cfg.min_updates, self.cfg.rule, self.cfg.trim)
        if d is not None:
            self._apply(d, len(report.senders))
        return report

    @torch.no_grad()
    def close_with_sum(self, total: Mapping[str, torch.Tensor] | None, senders: tuple[str, ...]) -> RoundReport:
        """Close the round with the sum of its members' deltas (secure aggregation: the deltas never came)."""
        r = self.round
        applied = total is not None and len(senders) >= max(1, self.cfg.min_updates)
        if applied:
            mean = {k: (t.double() / len(senders)).float() for k, t in total.items()}
            self._apply(mean, len(senders))
        self.collector = RoundCollector(self.params, self.cfg.max_staleness, r + 1 if senders else r)
        return RoundReport(r, applied, tuple(sorted(senders)), counts={"accepted": len(senders)})

    def _apply(self, mean: Mapping[str, torch.Tensor], n: int) -> None:
        if self.cfg.dp_noise > 0:  # noise on the sum, i.e. std / n on the mean
            noise = noise_like(mean, self.cfg.dp_noise * self.cfg.clip / n)
            mean = {k: t + noise[k] for k, t in mean.items()}
        for name, p in self.params.items():
            p.add_(mean[name].to(p.dtype), alpha=self.cfg.server_lr)

    def state_dict(self) -> dict:
        return {"round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.collector = RoundCollector(self.params, self.cfg.max_staleness, int(state["round"]))
