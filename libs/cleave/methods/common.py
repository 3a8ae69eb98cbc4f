"""What every method's math shares: the loss, the optimizer, one local step, parameter snapshots, shards.

Each helper does exactly what `cleave.train.trainer.Trainer` does (same loss, same AdamW parameter groups, same
global-norm clipping, the same mixed precision: `use_precision` routes the linear layers' GEMMs as the reference
does, the forward runs under autocast and fp16 scales the loss), so that a method that degenerates to plain
training reproduces it step for step, in any precision.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from cleave.errors import WireError
from cleave.gemm import tiled
from cleave.gemm.head import head_loss
from cleave.models import head_chunks
from cleave.models.gemms import head_slices
from cleave.train import precision as amp
from cleave.train.data import Corpus
from cleave.train.job import JobConfig
from cleave.train.trainer import make_adamw as make_adamw  # the round methods' workers train as the PS does

Batch = tuple[torch.Tensor, torch.Tensor]  # token ids (B, T) and next-token targets (B, T)
State = dict[str, torch.Tensor]
SHARD_SEED_STRIDE = 1_000_003  # distinct batch streams per data shard; shard 0 is the reference stream
MAX_SHARDS = 1 << 20  # keeps (seed + shard * stride) * 1_000_003 + step inside torch's int64 seed


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str = "fp32",
            grad_scale: float = 1.0) -> torch.Tensor:
    """Mean next-token cross-entropy (targets of -100 are skipped), as the PS's Trainer computes it: the forward
    under the job's autocast, then the head and loss in chunks of tokens (`cleave.gemm.head`), so that a round
    trains as the same-precision reference does, sum for sum; its backward is to be given `grad_scale`."""
    cfg = model.config
    with amp.autocast(precision, x.device):
        h = model.hidden(x)  # (B, T, C)
    return head_loss(model.lm_head, h.reshape(-1, h.size(-1)), y.reshape(-1), head_chunks(cfg, y.numel()),
                     head_slices(cfg), grad_scale)

def use_precision(model: nn.Module, precision: str) -> nn.Module:
    """Under bf16 or fp16, every linear layer's GEMMs as the reference computes them (`cleave.train.precision`).
    Call after `attach_lora` (the adapters' base layers are linear layers too)."""
    dtype = amp.dtype_of(precision)
    if dtype is not None:
        tiled.install(model, amp.LocalGemm(), dtype)
    return model



def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, grad_clip: float = 0.0,
               precision: str = "fp32") -> float:
    """One optimizer step on one batch; the loss before the step. Raises FloatingPointError if not finite.
    fp16 scales the loss and skips the step on an overflow, as the Trainer does (its scale lives in `opt`)."""
    x, y = batch
    model.train()
    scaler = amp.LossScaler(opt) if precision == "fp16" else None
    scale = float(torch.tensor(scaler.value if scaler else 1.0))  # as backward gets it (float32)
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model, x, y, precision, scale)
    loss.backward(torch.full_like(loss, scale))  # the head's gradients were computed scaled, as the Trainer's
    finite = True
    if scaler is not None:
        finite = scaler.unscale()
        scaler.update(not finite)
    if finite:
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=False)
        opt.step()
    value = loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"local loss is {value}: the local training diverged (a lower --lr may help)")
    return value


def local_train(
    model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Batch], steps: int, grad_clip: float = 0.0,
    precision: str = "fp32",
) -> list[float]:
    """`steps` optimizer steps on the first `steps` batches; the loss of each. Fewer batches is an error."""
    losses = []
    for batch in batches:
        if len(losses) == steps:
            break
        losses.append(train_step(model, opt, batch, grad_clip, precision))
    if len(losses) < steps:
        raise ValueError(f"local_train needs {steps} batches, got {len(losses)}")
    return losses


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that train and travel (tied weights once; frozen LoRA bases left out)."""
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def snapshot(params: Mapping[str, torch.Tensor]) -> State:
    """A detached copy, safe to keep while the parameters move on."""
    return {k: p.detach().clone() for k, p in params.items()}


@torch.no_grad()
def load_into(params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` into the parameters in place (optimizer state keeps pointing at them)."""
    check_state(params, state)
    for k, p in params.items():
        p.copy_(state[k])


def check_state(reference: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """WireError unless `state` has exactly the reference's names and shapes and only finite values."""
    if set(state) != set(reference):
        missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
        raise WireError("bad_state", f"missing {missing[:3]}, unexpected {extra[:3]}")
    for k, ref in reference.items():
        t = state[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise WireError("bad_state", f"{k}: shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WireError("bad_state", f"{k}: non-finite values")


def shard_of(worker_id: str) -> int:
    """A stable data shard number for a worker name (the same on every machine and every run)."""
    return zlib.crc32(worker_id.encode()) % MAX_SHARDS


VAL_BATCHES = 4  # batches in one validation loss, as `Trainer.val_loss` takes them


def val_batches(corpus: Corpus, job: JobConfig, step: int, n: int = VAL_BATCHES) -> list[Batch]:
    """The validation batches `Trainer.val_loss(step)` reads, in its order."""
    return [corpus.batch(job.seed, 1_000_000 + step * n + i, job.batch_size, job.seq, "val") for i in range(n)]


def shard_batch(corpus: Corpus, job: JobConfig, shard: int, step: int) -> Batch:
    """Batch number `step` of data shard `shard`; shard 0 is exactly the reference run's batch `step`."""
    if not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"shard {shard} outside [0, {MAX_SHARDS})")
    return corpus.batch(job.seed + shard * SHARD_SEED_STRIDE, step, job.batch_size, job.seq)
