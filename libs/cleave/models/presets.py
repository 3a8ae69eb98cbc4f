"""Named model presets: their configs only (`cleave.models.build` builds a model), so that what reads a preset's
shapes (the CLI's hub commands, the scheduler) starts without torch."""

from __future__ import annotations

from cleave.models.config import ModelConfig, RopeScaling

PRESETS: dict[str, ModelConfig] = {
    # runs a training step in well under a second on 2 CPU cores
    "tiny": ModelConfig(family="gpt2", n_layer=2, n_head=2, n_embd=64, block_size=64),
    "tiny-llama": ModelConfig(
        family="llama",
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        intermediate_size=176,
        block_size=64,
        bias=False,
    ),
    # the demo's default: a few million parameters, a few seconds a step distributed on a laptop
    "small": ModelConfig(family="gpt2", n_layer=4, n_head=4, n_embd=128, block_size=128),
    # published shapes (GPT-2 Medium: 355M; Llama 3.2 1B)
    "gpt2-medium": ModelConfig(
        family="gpt2", vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024
    ),
    "llama3-1b": ModelConfig(
        family="llama",
        vocab_size=128256,
        block_size=8192,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        intermediate_size=8192,
        bias=False,
        tie_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    ),
}

# OPT (Zhang et al. 2022) as GPT-2-shaped decoders: fused q,k,v (same GEMM FLOPs and bytes as OPT's three),
# FFN 4x, learned positions (OPT's table has 2 extra rows, left out), tied lm_head, vocab 50272. Used for
# their GEMM shapes and sizes (cleave sim); OPT-350M's 512-wide embedding projection is left out.
_OPT = {  # name: (n_layer, n_embd, n_head)
    "opt-125m": (12, 768, 12),
    "opt-350m": (24, 1024, 16),
    "opt-1.3b": (24, 2048, 32),
    "opt-2.7b": (32, 2560, 32),
    "opt-6.7b": (32, 4096, 32),
    "opt-13b": (40, 5120, 40),
    "opt-30b": (48, 7168, 56),
    "opt-66b": (64, 9216, 72),
}
# Llama 2 (Touvron et al. 2023): untied lm_head, vocab 32000, context 4096; 70B uses 8 KV heads.
_LLAMA2 = {  # name: (n_layer, n_embd, n_head, n_kv_head, intermediate_size)
    "llama2-7b": (32, 4096, 32, 32, 11008),
    "llama2-13b": (40, 5120, 40, 40, 13824),
    "llama2-70b": (80, 8192, 64, 8, 28672),
}
for _name, (_l, _d, _h) in _OPT.items():
    PRESETS[_name] = ModelConfig(
        family="gpt2", vocab_size=50272, block_size=2048, n_layer=_l, n_head=_h, n_embd=_d
    )
for _name, (_l, _d, _h, _kv, _ff) in _LLAMA2.items():
    PRESETS[_name] = ModelConfig(
        family="llama",
        vocab_size=32000,
        block_size=4096,
        n_layer=_l,
        n_head=_h,
        n_kv_head=None if _kv == _h else _kv,  # None: plain multi-head attention (as HF writes it)
        n_embd=_d,
        intermediate_size=_ff,
        bias=False,
        tie_embeddings=False,
    )


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None

