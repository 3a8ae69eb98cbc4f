"""The learning-rate schedule: linear warmup, then cosine decay to a floor (nanoGPT's `get_lr`).

One pure function of the job and the optimizer-step index, so the PS, `--reference` and every method (the
Cleave trainer, DiLoCo's and FedAvg's inner steps, both halves of split learning) follow the same curve, and a
resumed run continues it from the persisted step with nothing else to store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

from cleave.train.job import JobConfig

if TYPE_CHECKING:  # (the schedule is arithmetic: a stack's supervisor reads it without torch)
    import torch

T = TypeVar("T")
DEFAULT_WARMUP_FRACTION = 0.05  # warmup_steps=None: this share of the run's optimizer steps ...
DEFAULT_MAX_WARMUP = 2000  # ... but no more than nanoGPT's warmup_iters
DEFAULT_FLOOR_RATIO = 0.1  # lr_min=None: lr / 10, nanoGPT's min_lr


def total_steps(job: JobConfig) -> int:
    """Optimizer steps in the run: `steps`, times the local steps per round for DiLoCo and FedAvg."""
    return job.steps * (job.local_steps if job.method in ("diloco", "fedavg") else 1)


def warmup_steps(job: JobConfig) -> int:
    if job.warmup_steps is not None:
        return job.warmup_steps
    return min(DEFAULT_MAX_WARMUP, max(1, round(DEFAULT_WARMUP_FRACTION * total_steps(job))))


def lr_at(job: JobConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if job.lr_schedule == "constant":
        return job.lr
    floor = job.lr * DEFAULT_FLOOR_RATIO if job.lr_min is None else job.lr_min
    warm, total = warmup_steps(job), total_steps(job)
    if step < warm:
        return job.lr * (step + 1) / (warm + 1)
    if step >= total or total <= warm:
        return floor
    ratio = (step - warm) / (total - warm)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (job.lr - floor)


def set_lr(opt: torch.optim.Optimizer, job: JobConfig, step: int) -> float:
    """Put step `step`'s learning rate into every parameter group of `opt`; returns it."""
    lr = lr_at(job, step)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def scheduled(opt: torch.optim.Optimizer, job: JobConfig, first: int, batches: Iterable[T]) -> Iterator[T]:
    """`batches`, setting `opt`'s learning rate for optimizer step first + i just before batch i is handed
    out (the local loops of DiLoCo and FedAvg take one step per batch)."""
    for i, batch in enumerate(batches):
        set_lr(opt, job, first + i)
        yield batch
