"""FedAvg (McMahan et al. 2017) with robust aggregation: private data stays on the client, deltas travel.

Per round r, with global trainable weights θ (the whole model, or only LoRA adapters, see `lora`):
- a client loads θ, takes E local steps on its own data and sends δ = θ_local - θ and its sample count;
- the server combines the δ that arrived (weighted mean by samples, coordinate-wise median, or trimmed
  mean; the round, late-update and leaver rules are those of `rounds`) and sets θ ← θ + lr_server · δ̄.

With one client, one local step and lr_server = 1, θ_next = θ_local: plain training.
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

    def __post_init__(self) -> None:
        if self.local_steps < 1 or self.server_lr <= 0:
            raise ConfigError("local_steps must be >= 1 and server_lr positive")
        if self.rule not in RULES or not 0 <= self.trim < 0.5:
            raise ConfigError(f"rule must be one of {', '.join(RULES)} and trim in [0, 0.5)")
        if self.max_staleness < 0 or self.min_updates < 1:
            raise ConfigError("max_staleness must be >= 0 and min_updates >= 1")


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
            for name, p in self.params.items():
                p.add_(d[name].to(p.dtype), alpha=self.cfg.server_lr)
        return report

    def state_dict(self) -> dict:
        return {"round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.collector = RoundCollector(self.params, self.cfg.max_staleness, int(state["round"]))
