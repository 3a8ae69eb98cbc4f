"""The model zoo: GPT-2 and Llama-style decoders, their configs and named presets.

The presets and the builders import torch when first used (`__getattr__`): a process that only reads a step's
GEMM shapes and order (the scheduler) starts without it.
"""

import importlib

from cleave.models.config import ModelConfig, RopeScaling
from cleave.models.gemms import (
    GemmShape,
    StepLayout,
    backward_pairs,
    gemm_shapes,
    head_chunks,
    is_backward,
    linear_layers,
    step_order,
)

__all__ = [
    "PRESETS",
    "GemmShape",
    "StepLayout",
    "ModelConfig",
    "RopeScaling",
    "build_model",
    "gemm_shapes",
    "head_chunks",
    "get_preset",
    "linear_layers",
    "backward_pairs",
    "is_backward",
    "step_order",
]

_LAZY = {"PRESETS": "cleave.models.presets", "build_model": "cleave.models.presets",
         "get_preset": "cleave.models.presets"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cleave.models' has no attribute {name!r}")
