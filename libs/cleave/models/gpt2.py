"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied lm_head (after nanoGPT's model.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cleave.models.config import ModelConfig
from cleave.models.embed import embed
from cleave.models.recompute import run_block


class Linear(nn.Linear):
    """nn.Linear computed as the PS computes its layers (`cleave.gemm.tiled`): the product, then the bias added.
    nn.Linear's own forward is one addmm, whose rounding depends on the CPU's kernel: MKL on AVX-512 CPUs starts
    the sum of a product with few rows from the bias (measured: one float32 ulp from the product plus the
    bias for GPT-2's layers at 128 rows, equal at 512), so the single-process reference would differ from the
    fleet by the machine it runs on. The bias's gradient is the sum of dY over the rows either way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one GEMM
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = Linear(cfg.mlp_width, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    RECOMPUTE_FREE = ("mlp.c_proj",)  # its product only feeds the residual sum (cleave.models.recompute)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.recompute = False  # checkpoint every block (cleave.models.recompute): keep its input, redo its forward
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab)."""
        return self.lm_head(self.hidden(idx))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> the final norm's output (B, T, C), what the head turns into logits."""
        B, T = idx.shape
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = embed(self.transformer.wte, idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = run_block(block, x, recompute=self.recompute)
        return self.transformer.ln_f(x)
