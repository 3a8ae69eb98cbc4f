"""The model zoo: GPT-2 and Llama-style decoders, their configs and named presets."""

from cleave.models.config import ModelConfig, RopeScaling
from cleave.models.presets import PRESETS, GemmShape, build_model, gemm_shapes, get_preset, linear_layers

__all__ = [
    "PRESETS",
    "GemmShape",
    "ModelConfig",
    "RopeScaling",
    "build_model",
    "gemm_shapes",
    "get_preset",
    "linear_layers",
]
