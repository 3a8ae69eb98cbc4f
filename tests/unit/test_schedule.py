"""The learning-rate schedule: nanoGPT's warmup + cosine, the same in the trainer, across a resume."""

from __future__ import annotations

import math

import pytest

from cleave.train import schedule
from cleave.train.checkpoint import encode, restore, snapshot
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer


def test_warmup_then_cosine_to_the_floor() -> None:
    job = JobConfig(steps=100, lr=1e-3, warmup_steps=10, lr_min=1e-4)
    lrs = [schedule.lr_at(job, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3)  # the peak, then only down
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    mid = 10 + 45
    assert lrs[mid] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    assert lrs[-1] > 1e-4 and schedule.lr_at(job, 100) == 1e-4


def test_defaults_are_nanogpts() -> None:
    job = JobConfig(steps=200, lr=6e-4)
    assert schedule.warmup_steps(job) == 10  # 5% of the run
    assert schedule.warmup_steps(JobConfig(steps=10**6)) == 2000  # nanoGPT's warmup_iters at most
    assert schedule.lr_at(job, 10**6) == pytest.approx(6e-5)  # lr / 10, nanoGPT's min_lr
    assert schedule.warmup_steps(JobConfig(steps=4, method="diloco", local_steps=5)) == 1  # 20 inner steps
    assert schedule.lr_at(JobConfig(lr_schedule="constant"), 3) == JobConfig().lr


def test_the_trainer_follows_it_and_a_resumed_run_continues_it() -> None:
    job = JobConfig(preset="tiny", steps=6, batch_size=2, seq_len=16, warmup_steps=2)
    plain = Trainer(job)
    want = []
    for s in range(job.steps):
        plain.step(s)
        want.append([g["lr"] for g in plain.opt.param_groups])
    assert want == [[schedule.lr_at(job, s)] * 2 for s in range(job.steps)]
    first = Trainer(job)
    for s in range(3):
        first.step(s)
    data, m = encode(snapshot(first.model, first.opt, job.job_id, 2, 1))
    second = Trainer(job)
    restore(second.model, second.opt, data, m)
    got = []
    for s in range(3, job.steps):
        second.step(s)
        got.append([g["lr"] for g in second.opt.param_groups])
    assert got == want[3:]
