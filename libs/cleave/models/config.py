"""Model configuration: one typed config for both decoder families, validated in one place."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class RopeScaling(BaseModel):
    """Llama 3's frequency-dependent RoPE scaling (Hugging Face's `"rope_type": "llama3"`).

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` keep their frequency,
    those longer than `original_max_position_embeddings / low_freq_factor` are slowed by `factor`, and the
    band between is interpolated smoothly.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: float = 8.0  # Llama 3.1 uses 8, Llama 3.2 uses 32
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # context length of pretraining

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling.factor and original_max_position_embeddings must be positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("rope_scaling needs 0 < low_freq_factor < high_freq_factor")
        return self


class ModelConfig(BaseModel):
    """Shape of a decoder-only transformer. Defaults describe a tiny GPT-2."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: Literal["gpt2", "llama"] = "gpt2"
    vocab_size: int = 256  # byte-level tokenizer by default
    block_size: int = 64  # longest sequence (learned positions for gpt2, RoPE table for llama)
    n_layer: int = 2
    n_head: int = 2
    n_kv_head: int | None = None  # llama grouped-query attention; None = n_head
    n_embd: int = 64
    intermediate_size: int | None = None  # MLP width; None = 4 * n_embd (gpt2)
    bias: bool = True  # gpt2 linears and norms carry biases, llama's do not
    tie_embeddings: bool = True  # lm_head shares the token embedding
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # llama only; None = plain RoPE

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.kv_heads <= 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.family == "llama" and (self.n_embd // self.n_head) % 2:
            raise ValueError("llama head size (n_embd / n_head) must be even for RoPE")
        if self.rope_scaling is not None and self.family != "llama":
            raise ValueError("rope_scaling applies to the llama family only; set it to None")
        for name in ("vocab_size", "block_size", "n_layer", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or 4 * self.n_embd
