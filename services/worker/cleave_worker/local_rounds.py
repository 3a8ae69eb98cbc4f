"""The worker's side of the data-parallel methods (diloco, fedavg): local training rounds.

A worker keeps one model and one AdamW per job across rounds (DiLoCo's inner optimizer state lives on the
worker), trains on its shard of the job's data or on its own data (`cleave worker --data SOURCE`, which never
leaves it: only its size in tokens travels), in the job's precision, and sends back the compressed update
with error feedback. Runs off the event loop.

The job's base weights and tokenizer are the PS's files: the worker reads them from the bundles it fetched
(`cleave.models.bundles`, `job_for_worker`), never from the paths in the job, which name the PS's disk.
Before it builds anything for a job the worker checks that the model, its optimizer state and the activations
fit its memory (`check_memory`); a job that does not is refused with the numbers, as is a job that wants its
members' own data when this worker declared none (`JobRefused`: the PS stops dealing this job to it).

Its state is kept per job (not per PS incarnation), and a round asked for again with the same global
weights and shard (a PS that restarted mid-round resumes at that round) is answered with the update already
computed: the inner optimizer and the error feedback step once per round, as in a run without the restart.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import structlog
from torch import nn

from cleave import codec
from cleave.compression import ErrorFeedback, get_compressor, raw_bytes, unpack
from cleave.errors import ConfigError, JobRefused
from cleave.methods import diloco, fedavg
from cleave.methods.common import make_adamw, shard_batch, trainable, use_precision
from cleave.methods.lora import attach_for_job, lora_targets
from cleave.models import build_model
from cleave.schemas import RoundTask, RoundUpdate
from cleave.train import preflight
from cleave.train.data import Corpus, check_vocab
from cleave.train.job import JobConfig
from cleave.train.schedule import scheduled
from cleave.train.trainer import load_init

MAX_JOBS = 2  # models kept for different jobs at once
GB = 1e9


@dataclass
class LocalJob:
    job: JobConfig
    model: nn.Module
    opt: object
    corpus: Corpus
    feedback: ErrorFeedback
    last: tuple[tuple, RoundUpdate] | None = None  # the last round's inputs and the update it gave


log = structlog.get_logger("worker")


def job_for_worker(job_config: str, base: Path | None, tokenizer: Path | None) -> JobConfig:
    """The job as this worker runs it: its base weights and tokenizer from the fetched bundles' directories."""
    raw = json.loads(job_config)
    if raw.get("init_from"):
        if base is None:
            raise ConfigError(f"job {raw.get('job_id')!r} starts from base weights the PS did not publish")
        raw["init_from"] = str(base)
    if raw.get("tokenizer", "bytes") != "bytes":
        if tokenizer is None:
            raise ConfigError(f"job {raw.get('job_id')!r} uses a tokenizer the PS did not publish")
        raw["tokenizer"] = str(tokenizer)
    return JobConfig.model_validate(raw)


def own_corpus(job: JobConfig, data: str | None, vocab_size: int) -> Corpus:
    """The job's data on this worker: its own (`data`, what it declared), else the job's. Own data it cannot use
    (unreadable, too small, malformed, not of the model's vocabulary) refuses the job for good, with a reason that
    names neither its path nor what it holds: the whole error stays in this worker's log."""
    try:
        corpus = Corpus.for_job(job, source=data)
        check_vocab(corpus.tokenizer, corpus.vocab_size, vocab_size, job.model_name)
    except ConfigError as e:
        if not data:
            raise
        log.warning("own_data_unusable", job=job.job_id, error=str(e))
        raise JobRefused(f"this worker's own data cannot be used for job {job.job_id!r} (its log says why; a worker "
                         "sends neither its data's path nor what it holds)") from None
    return corpus


def private(text: str, data: str | None) -> str:
    """`text` (an error sent to the PS) with this worker's data path, as given and resolved, left out."""
    for path in {data, str(Path(data).expanduser().resolve())} if data else ():
        text = text.replace(path, "<own data>")
    return text


def round_memory(job: JobConfig) -> dict[str, int]:
    """What a round of `job` holds on a worker: fp32 weights; for the trainable parameters their gradients,
    AdamW's two moments, the global weights and the update; the activations of one batch."""
    model = build_model(job.arch(), device="meta")
    params = sum(p.numel() for p in model.parameters())
    train = params
    if job.lora_rank:  # only the adapters train: (in + out) x rank per adapted projection
        train = sum(job.lora_rank * (m.in_features + m.out_features) for m in lora_targets(model, job))
    return {"weights": 4 * params, "gradients": 4 * train, "optimizer": 8 * train, "round copies": 8 * train,
            "activations": preflight.activation_bytes(job)}


def check_memory(job: JobConfig, budget: int) -> None:
    """Refuse a job whose round would not fit `budget` bytes (0: what the machine has available now)."""
    need = round_memory(job)
    have = budget or preflight.available_memory()
    if sum(need.values()) > have:
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in need.items())
        raise JobRefused(f"a round of job {job.job_id!r} needs about {sum(need.values()) / GB:.2f} GB here ({parts}) "
                      f"but {have / GB:.2f} GB are available; use lora_rank, a smaller batch_size or seq_len, or "
                      "give this worker more memory (CLEAVE_WORKER_ROUND_MEMORY_BYTES if the detected amount is wrong)")


class RoundRunner:
    def __init__(self, worker_id: str, data: str | None = None, memory_bytes: int = 0, lie_weight: float = 0.0) -> None:
        self.worker_id, self.data, self.memory_bytes, self.lie_weight = worker_id, data, memory_bytes, lie_weight
        self.jobs: dict[str, LocalJob] = {}

    def _local(self, task: RoundTask, base: Path | None, tokenizer: Path | None) -> LocalJob:
        key = f"{task.job}.{hashlib.sha256(task.job_config.encode()).hexdigest()[:16]}"
        if key not in self.jobs:
            job = job_for_worker(task.job_config, base, tokenizer)
            if job.own_data and not self.data:
                raise JobRefused(f"job {job.job_id!r} trains only on its members' own data and this worker declared "
                              "none (cleave worker --data SOURCE)")
            check_memory(job, self.memory_bytes)
            cfg = job.arch()
            model = build_model(cfg, seed=job.seed)
            if job.init_from:  # fine-tuning: the PS's base weights, fetched and verified
                load_init(model, cfg, job)
            use_precision(attach_for_job(model, job), job.precision)
            corpus = own_corpus(job, self.data, cfg.vocab_size)
            while len(self.jobs) >= MAX_JOBS:
                self.jobs.pop(next(iter(self.jobs)))
            self.jobs[key] = LocalJob(job, model, make_adamw(trainable(model).values(), job), corpus,
                                      ErrorFeedback(get_compressor(job.compress)))
            if self.data:
                log.info("data_tokenized", job=job.job_id, tokens=corpus.train_tokens)
        return self.jobs[key]

    def flops(self, task: RoundTask, base: Path | None = None, tokenizer: Path | None = None) -> float:
        """What a round of `task` costs in FLOPs (6 per parameter per token, forward and backward)."""
        local = self._local(task, base, tokenizer)
        job = local.job
        return 6.0 * sum(p.numel() for p in local.model.parameters()) * job.local_steps * job.batch_size * job.seq

    def run(self, task: RoundTask, base: Path | None = None, tokenizer: Path | None = None) -> RoundUpdate:
        """One round: load the global weights, train locally, return the compressed update."""
        local = self._local(task, base, tokenizer)
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
                                                job.grad_clip, job.precision)
            weight = float(job.local_steps * job.batch_size * job.seq)
        else:
            update = fedavg.client_update(local.model, local.opt, weights, batches, job.local_steps, job.grad_clip,
                                          job.precision)
            delta, losses, weight = update.delta, list(update.losses), float(update.samples)
        update = RoundUpdate(
            job=task.job, epoch=task.epoch, round=task.round, worker_id=self.worker_id,
            delta=local.feedback.pack(delta), weight=self.lie_weight or weight, losses=tuple(losses),
            raw_bytes=sum(raw_bytes(t) for t in delta.values()),
            data_tokens=local.corpus.train_tokens if self.data else 0,
        )
        local.last = (inputs, update)
        return update
