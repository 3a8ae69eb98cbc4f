"""One training step, identical for the reference run and the PS: model, data, loss, AdamW.

The only difference between the two is the GEMM backend installed into the linear layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cleave import tiled
from cleave.data import Corpus
from cleave.job import JobConfig
from cleave.models import build_model, get_preset


class Trainer:
    def __init__(self, job: JobConfig, backend: tiled.GemmBackend | None = None, corpus: Corpus | None = None) -> None:
        self.job = job
        self.cfg = get_preset(job.preset)
        self.model = build_model(self.cfg, seed=job.seed)
        if backend is not None:
            tiled.install(self.model, backend)
        self.corpus = corpus or Corpus(job.data, job.val_fraction)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": job.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=job.lr, betas=(job.beta1, job.beta2), foreach=False,
        )

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def step(self, step: int) -> float:
        """Run training step `step` (its batch is fixed by the seed and the step number)."""
        x, y = self.corpus.batch(self.job.seed, step, self.job.batch_size, self.job.seq)
        self.model.train()
        loss = self.loss(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.job.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.grad_clip, foreach=False)
        self.opt.step()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {step}")
        return value

    @torch.no_grad()
    def val_loss(self, step: int, batches: int = 4) -> float:
        """Validation loss on the held-out split (runs the model's forward GEMMs through the backend)."""
        self.model.eval()
        total = 0.0
        for i in range(batches):
            x, y = self.corpus.batch(self.job.seed, 1_000_000 + step * batches + i, self.job.batch_size, self.job.seq, "val")
            total += self.loss(x, y).item()
        return total / batches
