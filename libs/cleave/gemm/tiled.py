"""Linear layers whose three GEMMs go through a pluggable backend (local tiles or the worker fleet).

`install(model, backend)` turns every nn.Linear of a model into a TiledLinear in place (same parameters,
same state-dict keys, tied weights stay tied). Forward Y = X·Wᵀ, backward dX = dY·W and dW = dYᵀ·X are
each one `backend.gemm(a, bt, name)` call computing a · btᵀ. A backend that can run GEMMs concurrently
(`submit`, the PS's fleet) gets the backward's two products together, and the weight gradient is deferred
(`LateGrads`): its tiles fill the tails of the backward GEMMs that follow, and it is added to `weight.grad`
by the end of the backward pass. Under a low precision (`cleave.train.precision`)
the inputs of each GEMM are cast to it (and saved for backward in it), the backend returns the product in it,
and the gradients go back to the float32 input and master weight: torch.autocast's semantics.
A layer whose product a block's recomputation does not need (`cleave.models.recompute`) skips its GEMM
while recomputing: it only saves its input again for its own backward.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch
from torch import nn

from cleave.gemm import tiles
from cleave.gemm.transpose import transposed
from cleave.models import linear_layers
from cleave.models.recompute import recompute_free, recomputing


class GemmBackend(Protocol):
    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        """a[m, k] · bt[n, k]ᵀ -> [m, n]."""
        ...


class Pending(Protocol):
    """A GEMM submitted to a concurrent backend."""

    def result(self) -> torch.Tensor: ...

    def cancel(self) -> None: ...


class LateGrads:
    """Weight gradients whose GEMMs are still running: each is added to its weight's `.grad` once done, in
    the order they were submitted, at the latest when the backward pass ends (a callback queued on
    autograd's engine, as DistributedDataParallel does), so `loss.backward()` returns with every gradient
    in place. At most `limit` wait at once (a further one first settles the oldest): each holds its GEMM's
    inputs. What an abandoned backward pass left (it raised) is cancelled when the next one adds.

    Autograd would have accumulated the same products into the same `.grad`s; only a weight used by several
    layers (tied embeddings: the output layer's product and the embedding's gradient) gets its terms in
    another order, and a sum of two floats is the same either way."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending: deque[tuple[torch.nn.Parameter, Pending]] = deque()
        self._pass = -1  # autograd's graph task that the pending ones belong to

    def add(self, weight: torch.nn.Parameter, pending: Pending) -> None:
        """Called from a backward function: `pending` is added in at the end of this backward pass."""
        task = torch._C._current_graph_task_id()
        if task != self._pass:
            self.cancel()
            self._pass = task
        self.pending.append((weight, pending))
        torch.autograd.Variable._execution_engine.queue_callback(self.settle)
        while len(self.pending) > self.limit:
            self._apply(*self.pending.popleft())

    def settle(self) -> None:
        """Wait for every weight gradient still running and add it in."""
        while self.pending:
            self._apply(*self.pending.popleft())

    def cancel(self) -> None:
        """The step is abandoned: nothing still running is added."""
        while self.pending:
            self.pending.popleft()[1].cancel()

    @staticmethod
    def _apply(weight: torch.nn.Parameter, pending: Pending) -> None:
        dw = pending.result().to(weight.dtype)
        weight.grad = dw if weight.grad is None else weight.grad + dw


class _Computed:
    """A GEMM a backend without `submit` computed when asked (`_Computed.of(backend)` submits that way)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def result(self) -> torch.Tensor:
        return self.out

    @staticmethod
    def of(backend: GemmBackend):  # noqa: ANN205
        return lambda a, bt, name, priority=0: _Computed(backend.gemm(a, bt, name))


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
    def forward(ctx, x, weight, bias, backend: GemmBackend, name: str, dtype: torch.dtype | None,  # noqa: ANN001
                late: LateGrads | None, skip: bool):
        x2 = _cast(x.reshape(-1, x.shape[-1]), dtype).contiguous()  # (B, T, K) -> (B*T, K)
        if skip:  # a recomputation that needs only what this layer saves: no product (its value is unused)
            y = x2.new_empty(x2.shape[0], weight.shape[0])
        else:
            y = backend.gemm(x2, _cast(weight.detach(), dtype).contiguous(), name + ".fwd")  # X·Wᵀ
        if bias is not None and not skip:
            y = y + _cast(bias, dtype)
        ctx.save_for_backward(x2, weight)
        # the Parameter itself: under recomputation (cleave.models.recompute) the saved tensors come back as
        # detached aliases, and a deferred gradient set on one of those would never reach the parameter
        ctx.param = weight
        ctx.backend, ctx.name, ctx.x_shape, ctx.has_bias = backend, name, x.shape, bias is not None
        ctx.dtype, ctx.x_dtype, ctx.late = dtype, x.dtype, late
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        x2, weight = ctx.saved_tensors
        dy2 = _cast(dy.reshape(-1, dy.shape[-1]), ctx.dtype).contiguous()  # (B*T, N)
        dx = dw = db = None
        # the fleet runs both at once, the weight gradient deferred behind the input gradient (`LateGrads`);
        # any other backend computes each as it is asked, in the same order
        submit = ctx.backend.submit if ctx.late is not None else _Computed.of(ctx.backend)
        dx_at = submit(dy2, transposed(_cast(weight, ctx.dtype)), ctx.name + ".dx",  # dY·W
                       priority=0) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            dw_at = submit(transposed(dy2), transposed(x2), ctx.name + ".dw", priority=1)  # dYᵀ·X
            if ctx.late is not None:
                ctx.late.add(ctx.param, dw_at)
            else:
                dw = dw_at.result().to(weight.dtype)
        if dx_at is not None:
            dx = dx_at.result().view(ctx.x_shape).to(ctx.x_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None, None, None


class TiledLinear(nn.Linear):
    """An nn.Linear whose GEMMs run on `self.backend`; created only by `install`."""

    backend: GemmBackend
    gemm_name: str
    gemm_dtype: torch.dtype | None  # the GEMMs' low precision; None: as the inputs come (float32)
    late_grads: LateGrads | None  # where deferred weight gradients wait (None: computed in the backward)
    recompute_free: bool  # a recomputation of its block skips its product (cleave.models.recompute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TiledLinearFn.apply(x, self.weight, self.bias, self.backend, self.gemm_name, self.gemm_dtype,
                                    self.late_grads, self.recompute_free and recomputing())


def install(model: nn.Module, backend: GemmBackend, dtype: torch.dtype | None = None,
            late: LateGrads | None = None) -> nn.Module:
    """Route every linear layer of `model` through `backend`, keeping its parameters and keys; `dtype`: the
    precision its GEMMs take their inputs and give their products in (None: the inputs' own); `late`: defer
    the weight gradients there (the backend must have `submit`)."""
    free = recompute_free(model)
    for name, lin in linear_layers(model).items():
        lin.__class__ = TiledLinear  # same storage, same Parameter objects: tied weights stay tied
        lin.backend, lin.gemm_name, lin.gemm_dtype, lin.late_grads = backend, name, dtype, late
        lin.recompute_free = name in free
    return model
