"""The model zoo: GPT-2 and Llama-style decoders, their configs and named presets."""

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
from cleave.models.presets import PRESETS, build_model, get_preset

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
