"""One training step, identical for the reference run and the PS: model, data, loss, AdamW.

The only difference between the two is the GEMM backend installed into the linear layers. A step runs the
job's micro-batches one after another, each a forward, the head and loss in chunks of tokens
(`cleave.gemm.head`) and a backward whose gradients add up in `.grad`, then clips and steps once; with
`recompute` every block keeps only its input and runs its forward again in the backward
(`cleave.models.recompute`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from cleave.errors import ConfigError, StepAborted
from cleave.gemm import tiled
from cleave.gemm.head import head_loss
from cleave.models import ModelConfig, build_model, head_chunks
from cleave.models.hf import check_state_dict, load_hf, our_shapes
from cleave.train import precision, schedule
from cleave.train.data import Corpus, check_vocab
from cleave.train.job import JobConfig

# the config fields that change what a set of weights computes (block_size only bounds the context)
INIT_FIELDS = ("family", "vocab_size", "n_layer", "n_head", "kv_heads", "n_embd", "mlp_width", "bias",
               "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling")


def load_init(model: torch.nn.Module, cfg: ModelConfig, job: JobConfig) -> None:
    """Copy the weights of the Hugging Face directory `job.init_from` into `model`, after checking that its
    config computes the same function as the preset's (when a preset is given) and that every key and shape
    matches."""
    hf_cfg, sd = load_hf(job.init_from)
    check_init(hf_cfg, cfg, job)
    check_state_dict(our_shapes(cfg), sd, f"init_from={job.init_from!r}")
    model.load_state_dict(sd)


def check_init(hf_cfg: ModelConfig, cfg: ModelConfig, job: JobConfig) -> None:
    """`job.init_from`'s config (`hf_cfg`) computes the same function as the model's (`cfg`: its preset's)."""
    differ = [f"{f} is {getattr(hf_cfg, f)!r} there, {getattr(cfg, f)!r} in the preset"
              for f in INIT_FIELDS if getattr(hf_cfg, f) != getattr(cfg, f)]
    if differ:
        raise ConfigError(f"init_from={job.init_from!r} does not fit preset={job.preset!r}: " + "; ".join(differ))


def resolve_device(name: str) -> torch.device:
    """"auto" is CUDA when this machine has it, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device here; use device='auto' or 'cpu'")
    return torch.device(name)


def make_adamw(params: Iterable[nn.Parameter], job: JobConfig) -> torch.optim.AdamW:
    """AdamW as every trainer of a job builds it (the PS, the reference, the round methods' workers): weight decay
    on matrices only, the trainable parameters only; fused, one kernel per step (the single-tensor step holds two
    temporaries the size of a parameter: 2.1 GB for Llama 3's embedding)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": job.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=job.lr, betas=(job.beta1, job.beta2), fused=True,
    )


class Trainer:
    """`group` (a PS replica's `cleave_ps.jobs.replicas.ReplicaGroup`): train on its share of each global batch and
    average the gradients over the group before the optimizer step (`last_sync`: its wait and all-reduce s)."""

    def __init__(self, job: JobConfig, backend: tiled.GemmBackend | None = None, corpus: Corpus | None = None,
                 group=None) -> None:  # noqa: ANN001
        self.job, self.group, self.last_sync = job, group, (0.0, 0.0)
        self.cfg = job.arch()
        self.device = resolve_device(job.device)
        self.model = build_model(self.cfg, seed=job.seed)  # initialised on the CPU: the same weights anywhere
        if job.init_from is not None:
            load_init(self.model, self.cfg, job)
        self.model.to(self.device)
        self.layout = job.layout(1 if group is None else group.replicas)
        self.model.recompute = self.layout.recompute
        self.dtype = precision.dtype_of(job.precision)
        if backend is None and self.dtype is not None:
            backend = precision.LocalGemm()  # the reference's GEMMs in the job's precision
        # a backend that runs GEMMs concurrently defers the weight gradients (`tiled.LateGrads`)
        limit = getattr(backend, "deferred_gemms", 0)
        self.late = tiled.LateGrads(limit) if limit > 0 else None
        if backend is not None:
            tiled.install(self.model, backend, self.dtype, self.late)
        self.corpus = corpus or Corpus.for_job(job)
        check_vocab(self.corpus.tokenizer, self.corpus.vocab_size, self.cfg.vocab_size, job.model_name)
        self.opt = make_adamw(self.model.parameters(), job)
        self.scaler = precision.LossScaler(self.opt) if job.precision == "fp16" else None
        self.skipped = 0  # fp16 steps skipped for an overflow in the gradients

    def hold_optimizer_state(self) -> None:
        """Allocate AdamW's moments now, as its first step would (zeros, step 0), unless they exist: the trainer
        then holds its peak memory from the first step on, not from the second (a job that does not fit fails
        in its first step, and one step measures the peak). The steps are the same, bit for bit."""
        if self.opt.state:
            return
        sd = self.opt.state_dict()
        params = [p for g in self.opt.param_groups for p in g["params"]]
        sd["state"] = {i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                           "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                       for i, p in enumerate(params)}
        self.opt.load_state_dict(sd)  # (tensors already of the parameter's dtype and device are kept, not copied)

    def loss(self, x: torch.Tensor, y: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """The mean loss over the tokens of x (B, T) against y; its backward is to be given `grad_scale`."""
        with precision.autocast(self.job.precision, self.device):
            h = self.model.hidden(x)  # (B, T, C)
        return head_loss(self.model.lm_head, h.view(-1, h.size(-1)), y.view(-1), head_chunks(self.cfg, y.numel(), self.job.logits_bytes), self.layout.head_slices, grad_scale)

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; the mean loss (the gradients are the mean's)."""
        k = self.layout.micro_batches
        scale = float(torch.tensor((self.scaler.value if self.scaler else 1.0) / k))  # as backward gets it
        total = torch.zeros((), device=self.device)
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            loss = self.loss(xs, ys, scale)
            try:  # (deferred weight gradients are in place when backward returns)
                loss.backward(torch.full_like(loss, scale))
            except BaseException:
                if self.late is not None:
                    self.late.cancel()
                raise
            total += loss.detach()
        return total / k

    def step(self, step: int) -> float:
        """Run training step `step` (its batch is fixed by the seed and the step number)."""
        x, y = self.corpus.batch(self.job.seed, step, self.job.batch_size, self.job.seq)
        if self.group is not None:
            x, y = self.group.share(x), self.group.share(y)
        x, y = x.to(self.device), y.to(self.device)
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss = self._backward(x, y)
        if self.group is not None:  # the global batch's mean gradient and loss, on every replica (so that
            value, *sync = self.group.average(self.model, loss)  # all take the same loss-scale decision)
            self.last_sync = tuple(sync)
        else:
            value = loss.item()
        if self.scaler is None or self._unscaled():
            if self.job.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.grad_clip, foreach=False)
            schedule.set_lr(self.opt, self.job, step)
            self.opt.step()
        if not math.isfinite(value):  # (the same step again, a restarted PS's, would only diverge again)
            raise StepAborted(f"the training diverged: loss is {value} at step {step}; a lower learning rate "
                              "(--lr) may help")
        return value

    def _unscaled(self) -> bool:
        """fp16: unscale the gradients and update the loss scale; False (the step is skipped) on an overflow."""
        finite = self.scaler.unscale()
        self.scaler.update(not finite)
        self.skipped += not finite
        return finite

    @torch.no_grad()
    def val_loss(self, step: int, batches: int = 4) -> float:
        """Validation loss on the held-out split (runs the model's forward GEMMs through the backend)."""
        self.model.eval()
        total = 0.0
        for i in range(batches):
            x, y = self.corpus.batch(self.job.seed, 1_000_000 + step * batches + i, self.job.batch_size, self.job.seq, "val")
            total += self.loss(x.to(self.device), y.to(self.device)).item()
        return total / batches
