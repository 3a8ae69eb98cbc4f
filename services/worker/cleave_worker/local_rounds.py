"""The worker's side of the data-parallel methods (diloco, fedavg): local training rounds.

A worker keeps one model and one AdamW per job across rounds (DiLoCo's inner optimizer state lives on the
worker), trains on its own shard (or its own local data, `CLEAVE_WORKER_DATA`), and sends back the
compressed update with error feedback. Runs off the event loop.

Its state is kept per job (not per PS incarnation), and a round asked for again with the same global
weights and shard (a PS that restarted mid-round resumes at that round) is answered with the update already
computed: the inner optimizer and the error feedback step once per round, as in a run without the restart.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import structlog
from torch import nn

from cleave import codec
from cleave.compression import ErrorFeedback, get_compressor, raw_bytes, unpack
from cleave.methods import diloco, fedavg
from cleave.methods.common import make_adamw, shard_batch, trainable
from cleave.methods.lora import attach_lora
from cleave.models import build_model
from cleave.schemas import RoundTask, RoundUpdate
from cleave.train.data import Corpus
from cleave.train.job import JobConfig
from cleave.train.schedule import scheduled
from cleave.train.trainer import load_init

MAX_JOBS = 2  # models kept for different jobs at once


@dataclass
class LocalJob:
    job: JobConfig
    model: nn.Module
    opt: object
    corpus: Corpus
    feedback: ErrorFeedback
    last: tuple[tuple, RoundUpdate] | None = None  # the last round's inputs and the update it gave


log = structlog.get_logger("worker")


class RoundRunner:
    def __init__(self, worker_id: str, data: Path | None = None) -> None:
        self.worker_id, self.data = worker_id, data
        self.jobs: dict[str, LocalJob] = {}

    def _local(self, task: RoundTask) -> LocalJob:
        key = f"{task.job}.{hashlib.sha256(task.job_config.encode()).hexdigest()[:16]}"
        if key not in self.jobs:
            job = JobConfig.model_validate_json(task.job_config)
            cfg = job.arch()
            model = build_model(cfg, seed=job.seed)
            if job.init_from:  # fine-tuning: the same base weights as the PS (the path must exist here too)
                load_init(model, cfg, job)
            if job.lora_rank:
                attach_lora(model, job.lora_rank, job.lora_alpha, seed=job.seed)
            corpus = Corpus(str(self.data) if self.data else job.data, job.val_fraction)
            while len(self.jobs) >= MAX_JOBS:
                self.jobs.pop(next(iter(self.jobs)))
            self.jobs[key] = LocalJob(job, model, make_adamw(trainable(model).values(), job), corpus,
                                      ErrorFeedback(get_compressor(job.compress)))
        return self.jobs[key]

    def flops(self, task: RoundTask) -> float:
        """What a round of `task` costs in FLOPs (6 per parameter per token, forward and backward)."""
        local = self._local(task)
        job = local.job
        return 6.0 * sum(p.numel() for p in local.model.parameters()) * job.local_steps * job.batch_size * job.seq

    def run(self, task: RoundTask) -> RoundUpdate:
        """One round: load the global weights, train locally, return the compressed update."""
        local = self._local(task)
        job = local.job
        inputs = (task.method, task.round, task.shard, hashlib.sha256(codec.encode(task.weights)).digest())
        if local.last is not None and local.last[0] == inputs:
            log.info("round_replayed", job=task.job, round=task.round, epoch=task.epoch)
            return local.last[1].model_copy(update={"epoch": task.epoch})
        weights = unpack(task.weights)
        first = task.round * job.local_steps
        batches = scheduled(local.opt, job, first,
                            (shard_batch(local.corpus, job, task.shard, first + i) for i in range(job.local_steps)))
        if task.method == "diloco":
            delta, losses = diloco.worker_round(local.model, local.opt, weights, batches, job.local_steps,
                                                job.grad_clip)
            weight = float(job.local_steps * job.batch_size * job.seq)
        else:
            update = fedavg.client_update(local.model, local.opt, weights, batches, job.local_steps, job.grad_clip)
            delta, losses, weight = update.delta, list(update.losses), float(update.samples)
        update = RoundUpdate(
            job=task.job, epoch=task.epoch, round=task.round, worker_id=self.worker_id,
            delta=local.feedback.pack(delta), weight=weight, losses=tuple(losses),
            raw_bytes=sum(raw_bytes(t) for t in delta.values()),
        )
        local.last = (inputs, update)
        return update
