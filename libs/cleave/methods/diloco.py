"""DiLoCo (Douillard et al. 2023): H local AdamW steps per worker, an outer Nesterov step on the PS.

Per round r, with global weights θ:
- each worker loads θ, takes H AdamW steps on its own data shard (its AdamW state stays on the worker
  across rounds) and sends the pseudo-gradient Δ = θ - θ_local, tagged with r and its weight (tokens);
- the PS averages the Δ that arrived (weighted by tokens, or a robust rule; `rounds` holds the round,
  late-update and leaver rules) and applies outer SGD with Nesterov momentum: θ ← θ - lr_out · nesterov(Δ̄).

With one worker, H = 1, lr_out = 1 and no momentum, θ_next = θ - (θ - θ_local) = θ_local: plain training.

Defaults (H 10, outer lr 1, no momentum) are measured, not quoted: at the scale of the built-in presets (tens
of rounds, `benchmarks/diloco_grid.py` on `small`) plain averaging learns best, and the paper's Nesterov
step (lr 0.7, momentum 0.9, tuned over thousands of rounds at H = 500) ends 0.4 higher. The paper's
setting stays available by name (`SETTINGS["paper"]`, `cleave train --diloco-setting paper`).
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
from cleave.methods.common import Batch, State, load_into, local_train, snapshot, trainable
from cleave.train.job import DEFAULT_LOCAL_STEPS, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM

DEFAULT_INNER_STEPS = DEFAULT_LOCAL_STEPS  # H: local steps between synchronisations (the job's default)
PAPER_INNER_STEPS = 500  # the DiLoCo paper's setting (Douillard et al. 2023, C4, 60M-400M models)
PAPER_OUTER_LR = 0.7
PAPER_OUTER_MOMENTUM = 0.9


@dataclass(frozen=True)
class DilocoConfig:
    inner_steps: int = DEFAULT_INNER_STEPS
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    nesterov: bool = True  # ignored when outer_momentum is 0
    max_staleness: int = 0  # late pseudo-gradients up to this many rounds old are folded in, weight 1/(1+s)
    min_updates: int = 1  # a round with fewer arrivals applies nothing
    rule: Rule = "mean"
    trim: float = DEFAULT_TRIM

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ConfigError(f"inner_steps={self.inner_steps} must be at least 1")
        if not (self.outer_lr > 0 and 0 <= self.outer_momentum < 1):
            raise ConfigError("outer_lr must be positive and outer_momentum in [0, 1)")
        if self.max_staleness < 0 or self.min_updates < 1:
            raise ConfigError("max_staleness must be >= 0 and min_updates >= 1")
        if self.rule not in RULES or not 0 <= self.trim < 0.5:
            raise ConfigError(f"rule must be one of {', '.join(RULES)} and trim in [0, 0.5)")


SETTINGS = {  # named outer settings: (H, outer lr, outer momentum); `cleave train --diloco-setting NAME`
    "default": (DEFAULT_INNER_STEPS, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM),  # measured on `small`
    "paper": (PAPER_INNER_STEPS, PAPER_OUTER_LR, PAPER_OUTER_MOMENTUM),
    "plain": (DEFAULT_INNER_STEPS, 1.0, 0.0),  # plain averaging of the workers' models (what FedAvg does)
}


def pseudo_gradient(global_state: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> State:
    """Δ = θ_global - θ_local: the direction the worker's H steps moved, as a gradient (descent = -Δ)."""
    return {k: (global_state[k] - local[k].detach()).float() for k in global_state}


def worker_round(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    global_state: Mapping[str, torch.Tensor],
    batches: Iterable[Batch],
    inner_steps: int,
    grad_clip: float = 0.0,
    precision: str = "fp32",
) -> tuple[State, list[float]]:
    """A worker's round: load θ, H local steps, return (Δ, the local losses)."""
    params = trainable(model)
    load_into(params, global_state)
    losses = local_train(model, opt, batches, inner_steps, grad_clip, precision)
    return pseudo_gradient(global_state, params), losses


class DilocoServer:
    """The PS side: the global parameters (owned by the caller's model), the outer optimizer, the round."""

    def __init__(self, params: Mapping[str, nn.Parameter], cfg: DilocoConfig, start_round: int = 0) -> None:
        self.cfg, self.params = cfg, dict(params)
        self.collector = RoundCollector(self.params, cfg.max_staleness, start_round)
        nesterov = cfg.nesterov and cfg.outer_momentum > 0
        self.opt = torch.optim.SGD(
            list(self.params.values()),
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=nesterov,
            foreach=False,
        )

    @property
    def round(self) -> int:
        return self.collector.round

    def global_state(self) -> State:
        """θ of the current round, to send to the workers."""
        return snapshot(self.params)

    def submit(self, sender: str, round: int, delta: Mapping[str, torch.Tensor], weight: float) -> Verdict:
        return self.collector.submit(sender, round, delta, weight)

    def close_round(self) -> RoundReport:
        """Average what arrived and take the outer step (or nothing, under `min_updates`)."""
        report, g = close_and_aggregate(self.collector, self.cfg.min_updates, self.cfg.rule, self.cfg.trim)
        if g is not None:
            for name, p in self.params.items():
                p.grad = g[name].to(p.dtype)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return report

    def state_dict(self) -> dict:
        """What to persist besides the parameters: the round and the outer momentum."""
        return {"round": self.round, "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.collector = RoundCollector(self.params, self.cfg.max_staleness, int(state["round"]))
        self.opt.load_state_dict(state["opt"])
