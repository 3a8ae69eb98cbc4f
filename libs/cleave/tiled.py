"""Linear layers whose three GEMMs go through a pluggable backend (local tiles or the worker fleet).

`install(model, backend)` turns every nn.Linear of a model into a TiledLinear in place (same parameters,
same state-dict keys, tied weights stay tied). Forward Y = X·Wᵀ, backward dX = dY·W and dW = dYᵀ·X are
each one `backend.gemm(a, bt, name)` call computing a · btᵀ.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from cleave import tiles
from cleave.models import linear_layers


class GemmBackend(Protocol):
    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        """a[m, k] · bt[n, k]ᵀ -> [m, n]."""
        ...


class LocalTiles:
    """Runs the tiling in this process: the distributed math without the network (tests, debugging)."""

    def __init__(self, block_rows: int = 64, block_cols: int = 64) -> None:
        self.block_rows, self.block_cols = block_rows, block_cols

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        return tiles.tiled_matmul(a, bt, tiles.grid(a.shape[0], bt.shape[0], self.block_rows, self.block_cols))


class _TiledLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, backend: GemmBackend, name: str):  # noqa: ANN001
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (B, T, K) -> (B*T, K)
        y = backend.gemm(x2, weight.detach().contiguous(), name + ".fwd")  # X·Wᵀ
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, weight)
        ctx.backend, ctx.name, ctx.x_shape, ctx.has_bias = backend, name, x.shape, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()  # (B*T, N)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = ctx.backend.gemm(dy2, weight.t().contiguous(), ctx.name + ".dx").view(ctx.x_shape)  # dY·W
        if ctx.needs_input_grad[1]:
            dw = ctx.backend.gemm(dy2.t().contiguous(), x2.t().contiguous(), ctx.name + ".dw")  # dYᵀ·X
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None


class TiledLinear(nn.Linear):
    """An nn.Linear whose GEMMs run on `self.backend`; created only by `install`."""

    backend: GemmBackend
    gemm_name: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TiledLinearFn.apply(x, self.weight, self.bias, self.backend, self.gemm_name)


def install(model: nn.Module, backend: GemmBackend) -> nn.Module:
    """Route every linear layer of `model` through `backend`, keeping its parameters and keys."""
    for name, lin in linear_layers(model).items():
        lin.__class__ = TiledLinear  # same storage, same Parameter objects: tied weights stay tied
        lin.backend, lin.gemm_name = backend, name
    return model
