"""Mixed precision, the job setting `precision: fp32|bf16|fp16`, with torch.autocast's semantics.

The master weights and the optimizer state stay float32. Under bf16 or fp16 the model's forward runs in
`torch.autocast` (the local ops, norms, softmax, attention, follow autocast's own lists), and every linear
layer's three GEMMs (`cleave.gemm.tiled`) take their inputs in the low precision, accumulate in float32 over the
whole K and round the product to the low precision once: what an autocast GEMM computes. The PS and
`--reference` run the same code; only where the GEMM runs differs (one local product here, tiles on the
fleet there, each block accumulated in float32 by its worker and rounded once before it travels back:
`TileTask.rounded`), so a bf16 run is exact against a bf16 reference while its input blocks and its results
travel in half the bytes.

fp16 adds loss scaling with torch.amp.GradScaler's rules (`LossScaler`); its state lives in the optimizer's
first parameter group, so that it is persisted and restored with the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# torch.amp.GradScaler's defaults
DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000


def dtype_of(precision: str) -> torch.dtype | None:
    """The GEMMs' low precision, or None for fp32 (nothing is cast)."""
    return DTYPES[precision]


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """The forward's context: torch.autocast in the low precision, nothing under fp32."""
    dt = DTYPES[precision]
    if dt is None:
        yield
        return
    with torch.autocast(device.type, dtype=dt):
        yield


class LocalGemm:
    """The reference's GEMM under a low precision: one product in this process, inputs as given, float32
    accumulation over the whole K, rounded once to the inputs' precision (the fleet's tiles do the same)."""

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        with torch.autocast(a.device.type, enabled=False):
            return (a.float() @ bt.float().T).to(a.dtype)


class LossScaler:
    """torch.amp.GradScaler's dynamic loss scale, deterministic, kept in `opt.param_groups[0]`.

    `scale(loss)` before backward; `unscale(opt)` divides every gradient by the scale and says whether all
    are finite; `update(found_inf)` halves the scale on an overflow (the step is skipped) and doubles it after
    `growth_interval` clean steps in a row."""

    def __init__(self, opt: torch.optim.Optimizer, init_scale: float = DEFAULT_INIT_SCALE,
                 growth_interval: int = DEFAULT_GROWTH_INTERVAL) -> None:
        self.opt, self.growth_interval = opt, growth_interval
        group = opt.param_groups[0]
        group.setdefault("loss_scale", init_scale)
        group.setdefault("loss_scale_clean_steps", 0)

    @property
    def value(self) -> float:
        return float(self.opt.param_groups[0]["loss_scale"])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def unscale(self) -> bool:
        """Divide the gradients by the scale; True when every one is finite."""
        inv = torch.tensor(1.0 / self.value, dtype=torch.float32)
        finite = True
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.mul_(inv.to(p.grad.device))
                finite = finite and bool(torch.isfinite(p.grad).all())
        return finite

    def update(self, found_inf: bool) -> None:
        group = self.opt.param_groups[0]
        if found_inf:
            group["loss_scale"] = self.value * DEFAULT_BACKOFF_FACTOR
            group["loss_scale_clean_steps"] = 0
            return
        group["loss_scale_clean_steps"] += 1
        if group["loss_scale_clean_steps"] >= self.growth_interval:
            group["loss_scale"] = self.value * DEFAULT_GROWTH_FACTOR
            group["loss_scale_clean_steps"] = 0
