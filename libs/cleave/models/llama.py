"""Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cleave.models.config import ModelConfig
from cleave.models.embed import embed
from cleave.models.recompute import run_block


def rope_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) of the rotary embedding, with Llama 3 scaling when configured."""
    hs = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float32, device=device) / hs))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor  # longer: slowed by factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor  # shorter: kept
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (T, head_dim), laid out as Hugging Face's rotate_half convention expects."""
    inv_freq = rope_frequencies(cfg, device)  # (hs/2,)
    freqs = torch.outer(torch.arange(T, dtype=torch.float32, device=device), inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.hs = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.hs, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, self.n_kv * self.hs, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, self.n_kv * self.hs, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.hs, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, heads*hs) -> (B, heads, T, hs)
        q = self.q_proj(x).view(B, T, self.n_head, self.hs).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_head:  # grouped-query attention: share each kv head
            rep = self.n_head // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.hs)  # (B, nh, T, hs) -> (B, T, C)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    RECOMPUTE_FREE = ("mlp.down_proj",)  # its product only feeds the residual sum (cleave.models.recompute)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.recompute = False  # checkpoint every block (cleave.models.recompute): keep its input, redo its forward
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab)."""
        return self.lm_head(self.hidden(idx))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the final norm's output (B, T, C), what the head turns into logits."""
        B, T = idx.shape
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size={self.config.block_size}")
        cos, sin = rope_tables(self.config, T, idx.device)
        x = embed(self.embed_tokens, idx)  # (B, T, C)
        for layer in self.layers:
            x = run_block(layer, x, cos, sin, recompute=self.recompute)
        return self.norm(x)
