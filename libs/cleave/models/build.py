"""Building a model from its config (this imports torch; the presets do not)."""

from __future__ import annotations

import torch
from torch import nn

from cleave.models.config import ModelConfig
from cleave.models.gpt2 import GPT2
from cleave.models.llama import Llama


def build_model(cfg: ModelConfig, seed: int | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights on every machine."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        return GPT2(cfg) if cfg.family == "gpt2" else Llama(cfg)
