"""LoRA adapters (Hu et al. 2021) on a model's attention and MLP projections, without touching model files.

`attach_lora(model, rank, alpha)` replaces the chosen nn.Linear modules by `LoRALinear`, which keeps the
frozen base layer and adds `(alpha / rank) · B·A·x` with A (rank, in) and B (out, rank). B starts at zero,
so a freshly adapted model computes exactly what the base model does. Every base parameter is frozen: only
the adapters train, and only they travel (`lora_state`). `merge_lora` folds the adapters into the base
weights and puts the plain nn.Linear modules back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from cleave.errors import ConfigError
from cleave.methods.common import State, load_into
from cleave.train.job import JobConfig

DEFAULT_TARGETS = (
    "c_attn",
    "c_proj",
    "c_fc",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)  # attention and MLP projections of GPT-2 and Llama; never lm_head (tied)
DEFAULT_ALPHA = 16.0


class LoRALinear(nn.Module):
    """y = base(x) + scale · (x·Aᵀ)·Bᵀ, base frozen, scale = alpha / rank."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        self.base, self.rank, self.scale = base, rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        bound = 1 / math.sqrt(base.in_features)  # kaiming-uniform with a = sqrt(5), as nn.Linear and PEFT
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
        for p in base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (..., in) -> (..., out); in a low precision's dtype under a half-precision job
        return y + ((x @ self.lora_A.t()) @ self.lora_B.t() * self.scale).to(y.dtype)

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base layer with the adapter folded into its weight: W + scale · B·A."""
        self.base.weight.add_(self.lora_B @ self.lora_A, alpha=self.scale)
        return self.base


def _targets(model: nn.Module, names: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Linear]]:
    found = []
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child_name in names:  # (a TiledLinear too: a bf16 job's layers)
                found.append((parent, child_name, child))
    return found


def lora_targets(model: nn.Module, job: JobConfig) -> list[nn.Linear]:
    """The linear layers a job's LoRA adapts (its `lora_targets`, or `DEFAULT_TARGETS`)."""
    return [lin for _, _, lin in _targets(model, job.lora_targets or DEFAULT_TARGETS)]


def attach_lora(
    model: nn.Module,
    rank: int,
    alpha: float = DEFAULT_ALPHA,
    targets: tuple[str, ...] | None = None,
    seed: int = 0,
) -> list[str]:
    """Freeze the model and put adapters on its `targets` projections (None: `DEFAULT_TARGETS`); the adapted
    module names.

    The same seed gives the same adapters everywhere (the server and every client start from one A).
    """
    if rank < 1:
        raise ConfigError(f"lora rank={rank} must be at least 1")
    targets = targets or DEFAULT_TARGETS
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    found = _targets(model, targets)
    if not found:
        raise ConfigError(f"no nn.Linear named one of {targets} in the model: nothing to adapt")
    for parent, child_name, lin in found:
        setattr(parent, child_name, LoRALinear(lin, rank, alpha, g))
    return [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def attach_for_job(model: nn.Module, job: JobConfig) -> nn.Module:
    """The job's adapters on `model` (rank, alpha, targets, seed), when it has any: the PS, every worker and
    the export build the same adapted model from the job alone."""
    if job.lora_rank:
        attach_lora(model, job.lora_rank, job.lora_alpha, job.lora_targets or None, job.seed)
    return model


def lora_state(model: nn.Module) -> State:
    """Only the adapter tensors (`...lora_A`, `...lora_B`), detached copies."""
    return {k: p.detach().clone() for k, p in model.named_parameters() if k.endswith((".lora_A", ".lora_B"))}


def load_lora_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    params = {k: p for k, p in model.named_parameters() if k.endswith((".lora_A", ".lora_B"))}
    load_into(params, state)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore the plain layers (the model is then unfrozen)."""
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, child_name, child.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
