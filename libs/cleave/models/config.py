"""Model configuration: one typed config for both decoder families, validated in one place."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


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

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.kv_heads <= 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.family == "llama" and (self.n_embd // self.n_head) % 2:
            raise ValueError("llama head size (n_embd / n_head) must be even for RoPE")
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
