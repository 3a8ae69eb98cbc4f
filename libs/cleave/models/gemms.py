"""A model's GEMMs: the shapes of every linear layer's forward and backward products per training step, read
off the model itself, and the order a step runs them in.

How a step runs them (`StepLayout`) changes the set: micro-batches run every GEMM once per micro-batch on
its share of the tokens; recomputation (`cleave.models.recompute`) runs each block's forward products again
in the backward (`<kind>.refwd`, all but the block's last projection); the head in chunks of tokens
(`cleave.gemm.head`) runs the head's three products once per chunk, the weight gradient's inner dimension
being the chunk's tokens (its dW comes back once per chunk), and the input gradient as a sum of products
over slices of the vocabulary (`<kind>.dx` and, for an unequal last slice, `<kind>.rest.dx`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cleave.models.config import ModelConfig

if TYPE_CHECKING:  # (a step's order and pairs are planned without torch: the scheduler never imports it)
    from torch import nn

HEAD = "lm_head"  # the output head's linear layer (not in a block)
DEFAULT_LOGITS_BYTES = 256 * 1024 * 1024  # float32 logits of one chunk of the head at most (a chunk of 1,024
# tokens for GPT-2's 50,257-token vocabulary, 512 for Llama 3's 128,256): what the head and loss hold at once
HEAD_SLICE: int | None = None  # the head's input gradient sums products over slices of at most this much of the
# vocabulary; None: the model's MLP width, so that its tiles carry no more input than those of a block's widest GEMM


@dataclass(frozen=True)
class StepLayout:
    """How a training step runs its GEMMs; the default is one pass over the whole batch."""

    recompute: bool = False  # each block's forward products again in the backward (activation checkpointing)
    micro_batches: int = 1  # the batch in this many equal parts, gradients accumulated
    head_chunks: int = 1  # the head and loss of each micro-batch in this many pieces of tokens
    head_slices: int = 1  # the head's input gradient as the sum over this many slices of the vocabulary

    @classmethod
    def of(cls, cfg: ModelConfig, micro_tokens: int, recompute: bool = False, micro_batches: int = 1,
           logits_bytes: int = DEFAULT_LOGITS_BYTES) -> StepLayout:
        """How a PS runs a step of `cfg` whose micro-batches have `micro_tokens` tokens each: the head in the
        chunks its logits budget leaves and the slices of the vocabulary (`JobConfig.layout`; the simulator's
        step is this one)."""
        return cls(recompute=recompute, micro_batches=micro_batches,
                   head_chunks=head_chunks(cfg, micro_tokens, logits_bytes), head_slices=head_slices(cfg))


def head_slices(cfg: ModelConfig) -> int:
    """Slices of the vocabulary that the head's input gradient is summed over (`HEAD_SLICE` each at most)."""
    return -(-cfg.vocab_size // (HEAD_SLICE or cfg.mlp_width))


def spans(n: int, pieces: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `pieces` pieces of n, cut as `torch.chunk` cuts them (the last may be smaller)."""
    size = -(-n // max(1, pieces))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def head_chunks(cfg: ModelConfig, tokens: int, logits_bytes: int = DEFAULT_LOGITS_BYTES) -> int:
    """The fewest equal pieces of `tokens` whose float32 logits each take at most `logits_bytes` (each token
    alone when even one exceeds it)."""
    per_token = cfg.vocab_size * 4
    return next((c for c in range(1, tokens + 1) if not tokens % c and tokens // c * per_token <= logits_bytes),
                tokens)


@dataclass(frozen=True)
class GemmShape:
    """One kind of GEMM C[m, n] = A[m, k] · B[k, n] and how often a training step runs it."""

    name: str  # e.g. "mlp.c_fc.fwd"
    m: int
    n: int
    k: int
    count_per_step: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    from torch import nn

    return {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


@functools.lru_cache(maxsize=32)
def _linear_kinds(cfg: ModelConfig) -> tuple[tuple[str, int, int, int, bool], ...]:
    """(kind, in_features, out_features, count, recomputed) of the model's linear layers (recomputed: a
    recomputation of its block runs its product); building even a meta model takes a second or so for the
    big presets, hence the cache (configs are frozen, so hashable)."""
    from cleave.models.build import build_model
    from cleave.models.recompute import recompute_free

    counts: dict[tuple[str, int, int, bool], int] = {}
    model = build_model(cfg, device="meta")
    free = recompute_free(model)
    for name, lin in linear_layers(model).items():
        kind = ".".join(
            p for p in name.split(".") if not p.isdigit() and p not in ("transformer", "h", "layers")
        )
        key = (kind, lin.in_features, lin.out_features, kind != HEAD and name not in free)
        counts[key] = counts.get(key, 0) + 1
    return tuple((kind, K, N, count, again) for (kind, K, N, again), count in counts.items())


def gemm_shapes(cfg: ModelConfig, batch: int, seq: int, layout: StepLayout | None = None) -> list[GemmShape]:
    """Forward Y=X·Wᵀ and backward dX=dY·W, dW=dYᵀ·X of every linear layer, grouped by kind, for a step of
    `batch` x `seq` tokens run as `layout` says (None: the default, one pass).

    Read off the model itself (built on the meta device, so even billion-parameter shapes are free).
    """
    lay = layout or StepLayout()
    micro = lay.micro_batches
    M = batch * seq // micro
    shapes = []
    for kind, K, N, count, again in _linear_kinds(cfg):
        m, times = (M, count * micro) if kind != HEAD else (M // lay.head_chunks, count * micro * lay.head_chunks)
        dx = [GemmShape(f"{kind}.dx", m, K, N, times)]  # dX = dY·W
        if kind == HEAD and lay.head_slices > 1:  # (the sum over slices of the vocabulary)
            sizes = [hi - lo for lo, hi in spans(N, lay.head_slices)]
            rest = [s for s in sizes if s != sizes[0]]
            dx = [GemmShape(f"{kind}.dx", m, K, sizes[0], times * (len(sizes) - len(rest)))]
            dx += [GemmShape(f"{kind}.rest.dx", m, K, s, times) for s in rest]
        shapes += [
            GemmShape(f"{kind}.fwd", m, N, K, times),  # Y = X·Wᵀ
            *dx,
            GemmShape(f"{kind}.dw", N, K, m, times),  # dW = dYᵀ·X
        ]
        if lay.recompute and again:
            shapes.append(GemmShape(f"{kind}.refwd", m, N, K, times))  # Y = X·Wᵀ again, in the backward
    return shapes


def is_backward(shape: GemmShape) -> bool:
    """Whether a GEMM kind is a backward one (an input or weight gradient)."""
    return shape.name.endswith((".dx", ".dw"))


def step_order(shapes: Sequence[GemmShape]) -> list[int]:
    """Indices into `shapes`, one per GEMM a step runs: forwards layer by layer, then backwards in reverse."""
    fwd = [i for i, s in enumerate(shapes) if not is_backward(s)]
    bwd = [i for i, s in enumerate(shapes) if is_backward(s)]
    order: list[int] = []
    for group, rev in ((fwd, False), (bwd, True)):
        depth = max((shapes[i].count_per_step for i in group), default=0)
        layers = [[i for i in group if shapes[i].count_per_step > d] for d in range(depth)]
        for layer in reversed(layers) if rev else layers:
            order += reversed(layer) if rev else layer
    return order


def backward_pairs(shapes: Sequence[GemmShape], order: Sequence[int]) -> list[tuple[int | None, int | None]]:
    """The backward GEMMs of `order` as the PS submits them: per linear layer (its input gradient, its weight
    gradient), indices into `shapes`, None where the layer has no such GEMM."""
    pairs: list[tuple[str, dict[str, int]]] = []
    for i in order:
        base, kind = shapes[i].name.rsplit(".", 1)
        if kind not in ("dx", "dw"):
            continue
        if pairs and pairs[-1][0] == base and kind not in pairs[-1][1]:
            pairs[-1][1][kind] = i
        else:
            pairs.append((base, {kind: i}))
    return [(p.get("dx"), p.get("dw")) for _, p in pairs]
