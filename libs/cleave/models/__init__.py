"""The model zoo: GPT-2 and Llama-style decoders, their configs and named presets.

The builder imports torch when first used (`__getattr__`): a process that only reads presets or a step's GEMM
shapes and order (the scheduler, the CLI's hub commands) starts without it.
"""

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
from cleave.models.presets import PRESETS, get_preset

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

def __getattr__(name: str) -> object:
    if name == "build_model":
        from cleave.models.build import build_model

        return build_model
    raise AttributeError(f"module 'cleave.models' has no attribute {name!r}")
