"""A model's GEMMs: the shapes of every linear layer's forward and backward products per training step, read
off the model itself, and the order a step runs them in."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from cleave.models.config import ModelConfig
from cleave.models.presets import build_model


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
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


@functools.lru_cache(maxsize=32)
def _linear_kinds(cfg: ModelConfig) -> tuple[tuple[str, int, int, int], ...]:
    """(kind, in_features, out_features, count) of the model's linear layers; building even a meta model
    takes a second or so for the big presets, hence the cache (configs are frozen, so hashable)."""
    counts: dict[tuple[str, int, int], int] = {}
    for name, lin in linear_layers(build_model(cfg, device="meta")).items():
        kind = ".".join(
            p for p in name.split(".") if not p.isdigit() and p not in ("transformer", "h", "layers")
        )
        key = (kind, lin.in_features, lin.out_features)
        counts[key] = counts.get(key, 0) + 1
    return tuple((kind, K, N, count) for (kind, K, N), count in counts.items())


def gemm_shapes(cfg: ModelConfig, batch: int, seq: int) -> list[GemmShape]:
    """Forward Y=X·Wᵀ and backward dX=dY·W, dW=dYᵀ·X of every linear layer, grouped by kind.

    Read off the model itself (built on the meta device, so even billion-parameter shapes are free).
    """
    M = batch * seq
    shapes = []
    for kind, K, N, count in _linear_kinds(cfg):
        shapes += [
            GemmShape(f"{kind}.fwd", M, N, K, count),  # Y = X·Wᵀ
            GemmShape(f"{kind}.dx", M, K, N, count),  # dX = dY·W
            GemmShape(f"{kind}.dw", N, K, M, count),  # dW = dYᵀ·X
        ]
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
