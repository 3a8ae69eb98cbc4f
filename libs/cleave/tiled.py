"""Linear layers whose three GEMMs go through a pluggable backend (local tiles or the worker fleet).

`install(model, backend)` turns every nn.Linear of a model into a TiledLinear in place (same parameters,
same state-dict keys, tied weights stay tied). Forward Y = X·Wᵀ, backward dX = dY·W and dW = dYᵀ·X are
each one `backend.gemm(a, bt, name)` call computing a · btᵀ. Under a low precision (`cleave.precision`)
the inputs of each GEMM are cast to it (and saved for backward in it), the backend returns the product in it,
and the gradients go back to the float32 input and master weight: torch.autocast's semantics.
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
        grid = tiles.grid(a.shape[0], bt.shape[0], self.block_rows, self.block_cols)
        with torch.autocast(a.device.type, enabled=False):  # as a worker: half inputs computed in float32
            return tiles.tiled_matmul(a.float(), bt.float(), grid).to(a.dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


class _TiledLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, backend: GemmBackend, name: str, dtype: torch.dtype | None):  # noqa: ANN001
        x2 = _cast(x.reshape(-1, x.shape[-1]), dtype).contiguous()  # (B, T, K) -> (B*T, K)
        y = backend.gemm(x2, _cast(weight.detach(), dtype).contiguous(), name + ".fwd")  # X·Wᵀ
        if bias is not None:
            y = y + _cast(bias, dtype)
        ctx.save_for_backward(x2, weight)
        ctx.backend, ctx.name, ctx.x_shape, ctx.has_bias = backend, name, x.shape, bias is not None
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        x2, weight = ctx.saved_tensors
        dy2 = _cast(dy.reshape(-1, dy.shape[-1]), ctx.dtype).contiguous()  # (B*T, N)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w = _cast(weight, ctx.dtype).t().contiguous()
            dx = ctx.backend.gemm(dy2, w, ctx.name + ".dx").view(ctx.x_shape).to(ctx.x_dtype)  # dY·W
        if ctx.needs_input_grad[1]:
            dw = ctx.backend.gemm(dy2.t().contiguous(), x2.t().contiguous(), ctx.name + ".dw")  # dYᵀ·X
            dw = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None


class TiledLinear(nn.Linear):
    """An nn.Linear whose GEMMs run on `self.backend`; created only by `install`."""

    backend: GemmBackend
    gemm_name: str
    gemm_dtype: torch.dtype | None  # the GEMMs' low precision; None: as the inputs come (float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TiledLinearFn.apply(x, self.weight, self.bias, self.backend, self.gemm_name, self.gemm_dtype)


def install(model: nn.Module, backend: GemmBackend, dtype: torch.dtype | None = None) -> nn.Module:
    """Route every linear layer of `model` through `backend`, keeping its parameters and keys; `dtype`: the
    precision its GEMMs take their inputs and give their products in (None: the inputs' own)."""
    for name, lin in linear_layers(model).items():
        lin.__class__ = TiledLinear  # same storage, same Parameter objects: tied weights stay tied
        lin.backend, lin.gemm_name, lin.gemm_dtype = backend, name, dtype
    return model
