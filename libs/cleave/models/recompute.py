"""Activation checkpointing per layer: a model with `recompute` on keeps only each transformer block's input
for the backward pass and runs the block's forward again when the backward reaches it
(`torch.utils.checkpoint`, non-reentrant). The recomputation gives back the very tensors the first forward
saved (every op here is deterministic), so the gradients are the same to the bit.

A block names the linear layers whose output its recomputation does not need (`RECOMPUTE_FREE`: the last
projection, whose product only feeds the residual sum): their layer still saves its input for its own
backward, but a linear layer that knows it (`cleave.gemm.tiled`) skips the product itself while
`recomputing()`, so a recomputed block costs its other GEMMs only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_state = threading.local()


def recomputing() -> bool:
    """Whether this thread is running a block's forward again for its backward."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def _recomputation() -> Iterator[None]:
    before = recomputing()
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _recomputation()  # (the first forward's, the recomputation's)


def run_block(block: Callable[..., torch.Tensor], x: torch.Tensor, *args: torch.Tensor, recompute: bool) -> torch.Tensor:
    """`block(x, *args)`, checkpointed when `recompute` is on and autograd records (a no-grad forward, such as
    a validation pass, saves nothing anyway)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, *args, use_reentrant=False, context_fn=_contexts)
    return block(x, *args)


def recompute_free(model: nn.Module) -> set[str]:
    """Names (as `named_modules` gives them) of the linear layers whose product a recomputation skips."""
    return {f"{name}.{sub}" if name else sub for name, mod in model.named_modules()
            for sub in getattr(mod, "RECOMPUTE_FREE", ())}
