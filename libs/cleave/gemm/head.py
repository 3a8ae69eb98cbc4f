"""The output head and the loss, in chunks of tokens: the whole batch's logits never exist at once.

`head_loss(head, h, targets, chunks, slices)` is the mean cross-entropy of `head(h)` against `targets`,
computed chunk by chunk of rows (tokens): each chunk's logits `X·Wᵀ`, its loss, and at once (when autograd
records) its gradients, the input gradient `dY·W` into its rows of dX and the weight gradient `dYᵀ·X` added
into dW, where dY is the chunk's `(softmax - onehot) x grad_scale / tokens`. The input gradient's inner
dimension is the vocabulary (128,256 for Llama 3): it is computed as the sum of `slices` products over
slices of the vocabulary, each an ordinary GEMM whose tiles carry no more than a block's widest layer's. The logits of a chunk are freed
before the next one's exist; what the backward pass then gives is dX and dW (added into the weight's `.grad`
at once, where a tied embedding adds its own in place), scaled by what actually arrives
(`grad_scale` is what the caller will pass to backward: 1, or a loss scale over micro-batches; anything
else is multiplied in, to the same result within rounding).

The GEMMs go where the head's other products go: a `TiledLinear`'s backend (the fleet on the PS), in its
precision with the same casts as its own backward (`cleave.gemm.tiled`), the input gradient's slices two
at a time and then the weight gradient (each GEMM's dispatcher keeps copies of its inputs and its whole
output until it is done: one at a time keeps the head's memory near one chunk's logits and two copies of
W); a plain `nn.Linear` computes them in this process. The PS and `--reference` run this same code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cleave.gemm.tiled import TiledLinear, _cast, _Computed
from cleave.gemm.transpose import transposed
from cleave.models.gemms import spans

IGNORE = -100  # a target the loss skips (prompts, padding): torch's cross_entropy ignore_index


class _Products:
    """The head's three products for one layer: through its backend, or plain torch for an nn.Linear."""

    def __init__(self, head: nn.Linear, slices: int = 1) -> None:
        self.tiled = isinstance(head, TiledLinear)
        self.slices = spans(head.weight.shape[0], slices)
        self.weight = head.weight.detach()
        self.name = head.gemm_name if self.tiled else "lm_head"
        self.dtype = head.gemm_dtype if self.tiled else None
        if self.tiled:
            late = head.late_grads
            self.gemm = head.backend.gemm
            self.submit = head.backend.submit if late is not None else _Computed.of(head.backend)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tiled:
            return F.linear(x, self.weight)
        return self.gemm(_cast(x, self.dtype).contiguous(), _cast(self.weight, self.dtype).contiguous(),
                         self.name + ".fwd")

    def transposed(self, g: torch.Tensor) -> torch.Tensor:
        """dYᵀ (vocab, rows) in the GEMMs' precision, contiguous: what the weight gradient's GEMM takes, and
        whose rows the input gradient's slices are cut from."""
        return transposed(_cast(g, self.dtype))

    def grads(self, dyt: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dX, dW) of one chunk from dYᵀ: dY·W as the sum over the vocabulary's slices (in float32, in order;
        two slices in flight, each with its own Wᵀ slice, so that no copy of the whole Wᵀ exists), then
        dYᵀ·X."""
        if not self.tiled:
            return _sum(dyt[lo:hi].t().mm(self.weight[lo:hi]) for lo, hi in self.slices), dyt.mm(x)
        dx, pending = None, deque()
        for lo, hi in self.slices:
            wt = transposed(_cast(self.weight[lo:hi], self.dtype))
            pending.append(self.submit(transposed(dyt[lo:hi]), wt, self.name + ".dx", priority=0))
            del wt
            if len(pending) > 1:
                dx = _add(dx, pending.popleft().result())
        while pending:
            dx = _add(dx, pending.popleft().result())
        return dx, self.gemm(dyt, transposed(_cast(x, self.dtype)), self.name + ".dw")


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part.float() if total is None else total.add_(part)


def _sum(parts: Iterator[torch.Tensor]) -> torch.Tensor:
    """The partial products added up in float32, in order."""
    total = None
    for p in parts:
        total = _add(total, p)
    return total


def _chunk_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y, reduction="sum", ignore_index=IGNORE)


def _counted(targets: torch.Tensor) -> int:
    """The tokens the mean is over: those whose target is not skipped (as cross_entropy's mean counts)."""
    return int((targets != IGNORE).sum())


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, head, chunks: int, slices: int, grad_scale: float):  # noqa: ANN001
        prod, n = _Products(head, slices), _counted(targets)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h)
        dw = None
        for lo, hi in spans(h.shape[0], chunks):
            x, y = h[lo:hi], targets[lo:hi]
            logits = prod.logits(x)  # (rows, vocab): only this chunk's
            total += _chunk_loss(logits, y)
            g = torch.softmax(logits.float(), dim=-1)
            del logits
            kept = y != IGNORE
            g[torch.arange(hi - lo, device=g.device)[kept], y[kept]] -= 1.0
            g[~kept] = 0.0  # a skipped target's row: no loss, no gradient
            g *= grad_scale / n  # dY of the mean loss, times what backward will pass
            dyt = prod.transposed(g)
            del g
            dx_c, dw_c = prod.grads(dyt, x)
            del dyt
            dh[lo:hi] = dx_c.to(h.dtype)
            dw = dw_c.to(weight.dtype) if dw is None else dw.add_(dw_c)
            del dx_c, dw_c  # (the next chunk's products must not find these still held)
        ctx.dh, ctx.dw, ctx.grad_scale, ctx.weight = dh, dw, grad_scale, weight
        return total / n

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        dh, dw = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None
        factor = grad / ctx.grad_scale
        if bool(factor != 1):
            dh, dw = dh * factor.to(dh.dtype), dw.mul_(factor.to(dw.dtype))
        weight = ctx.weight  # dW goes straight into .grad, where a tied embedding adds its own in place
        if weight.requires_grad:  # (a frozen head, as under LoRA, keeps no gradient)
            weight.grad = dw if weight.grad is None else weight.grad.add_(dw)  # (cleave.models.embed)
        return dh, None, None, None, None, None, None


def head_loss(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor, chunks: int = 1, slices: int = 1,
              grad_scale: float = 1.0) -> torch.Tensor:
    """Mean cross-entropy of `head(h)` (h: (tokens, C), targets: (tokens,), those of IGNORE skipped, as
    torch's cross_entropy skips them) in `chunks` pieces of rows, the
    input gradient summed over `slices` of the vocabulary; its backward pass will be given `grad_scale` (the
    gradients are computed here, for that)."""
    if head.bias is not None:
        raise ValueError("head_loss needs an output head without a bias")
    if not (torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad)):
        prod, total = _Products(head), torch.zeros((), dtype=torch.float32, device=h.device)
        for lo, hi in spans(h.shape[0], chunks):
            total += _chunk_loss(prod.logits(h[lo:hi]), targets[lo:hi])
        return total / _counted(targets)
    return _HeadLoss.apply(h, head.weight, targets, head, chunks, slices, grad_scale)
