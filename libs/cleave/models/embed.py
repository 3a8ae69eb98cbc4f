"""The token embedding's lookup, whose gradient is added in place into the weight's `.grad` when one is
already there (the tied output head's, computed earlier in the same backward pass by `cleave.gemm.head`, or
an earlier micro-batch's): autograd's own embedding backward builds a dense (vocab, C) gradient first, as
large as the weight (1 GB for Llama 3's 128k vocabulary), and only then adds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, weight):  # noqa: ANN001
        ctx.save_for_backward(idx)
        ctx.weight = weight
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        (idx,) = ctx.saved_tensors
        weight, rows = ctx.weight, grad.reshape(-1, grad.shape[-1]).to(ctx.weight.dtype)
        if weight.grad is None:  # autograd keeps this one as .grad: nothing extra is allocated
            dense = torch.zeros_like(weight)
            return None, dense.index_add_(0, idx.reshape(-1), rows)
        weight.grad.index_add_(0, idx.reshape(-1), rows)
        return None, None


def embed(table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    """`table(idx)`, with the gradient added in place where the weight already has one."""
    if not torch.is_grad_enabled() or not table.weight.requires_grad:
        return table(idx)
    return _Lookup.apply(idx, table.weight)
