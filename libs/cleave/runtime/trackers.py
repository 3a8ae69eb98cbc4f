"""Experiment trackers people already watch runs in: TensorBoard and Weights & Biases, fed the per-step metrics
lines (the `--metrics-out` fields) as they come.

`--log-to tensorboard:DIR` writes TensorBoard event files under DIR (`tensorboard --logdir DIR` shows them);
`--log-to wandb:PROJECT` logs to a W&B project (`WANDB_MODE=offline` keeps it on disk). Each needs its
package, an extra of ours and not a dependency: `pip install 'cleave-train[tensorboard]'` or `[wandb]`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from typing import Any, Protocol

from cleave.errors import ConfigError

KINDS = ("tensorboard", "wandb")
# the line's fields that are curves, under the names the trackers show (section/name)
SCALARS = {
    "loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr", "step_time_s": "time/step_s",
    "gemm_s": "time/gemm_s", "tokens_per_s": "time/tokens_per_s", "workers": "fleet/workers", "tiles": "fleet/tiles",
    "tiles_resent": "fleet/tiles_resent", "tiles_copied": "fleet/tiles_copied", "recoveries": "fleet/recoveries",
    "bytes_down": "bytes/down", "bytes_up": "bytes/up", "updates": "rounds/updates",
}


class Tracker(Protocol):
    def log(self, line: Mapping[str, Any]) -> None:
        """One metrics line (its `step` is the x axis)."""

    def close(self) -> None: ...


def scalars(line: Mapping[str, Any]) -> dict[str, float]:
    """The curves of one metrics line: every finite number of SCALARS, and tokens a second."""
    values = dict(line)
    if line.get("tokens") and line.get("step_time_s"):
        values["tokens_per_s"] = line["tokens"] / line["step_time_s"]
    out = {}
    for key, name in SCALARS.items():
        v = values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


class TensorBoard:
    def __init__(self, logdir: str, run_name: str = "") -> None:
        writer = _need("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.writer = writer(log_dir=logdir, comment=run_name)

    def log(self, line: Mapping[str, Any]) -> None:
        for name, value in scalars(line).items():
            self.writer.add_scalar(name, value, global_step=int(line["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, project: str, run_name: str = "", config: Mapping[str, Any] | None = None) -> None:
        self.wandb = _need("wandb", "wandb")
        self.run = self.wandb.init(project=project, name=run_name or None, config=dict(config or {}))

    def log(self, line: Mapping[str, Any]) -> None:
        self.run.log(scalars(line), step=int(line["step"]))

    def close(self) -> None:
        self.run.finish()


def parse(spec: str) -> tuple[str, str]:
    """'tensorboard:DIR' or 'wandb:PROJECT' -> (kind, target); a ConfigError naming the choices otherwise."""
    kind, sep, target = spec.partition(":")
    if kind not in KINDS or not sep or not target:
        raise ConfigError(f"--log-to {spec!r}: expected tensorboard:DIR or wandb:PROJECT")
    return kind, target


def tracker(spec: str, run_name: str = "", config: Mapping[str, Any] | None = None) -> Tracker:
    kind, target = parse(spec)
    return TensorBoard(target, run_name) if kind == "tensorboard" else WandB(target, run_name, config)


class Trackers:
    """Several trackers fed the same lines; each line once, in step order as the caller sees them."""

    def __init__(self, specs: list[str] | tuple[str, ...], run_name: str = "",
                 config: Mapping[str, Any] | None = None) -> None:
        for spec in specs:  # every spec checked before any tracker opens a file or a connection
            parse(spec)
        self.all = [tracker(s, run_name, config) for s in specs]

    def log(self, line: Mapping[str, Any]) -> None:
        for t in self.all:
            t.log(line)

    def close(self) -> None:
        for t in self.all:
            t.close()


def _need(module: str, extra: str):  # noqa: ANN202 - the module
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--log-to {extra} needs the {extra} package: pip install 'cleave-train[{extra}]'") from None
