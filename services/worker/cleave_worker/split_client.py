"""The worker's side of split learning: it keeps the embedding, the first k blocks and its data.

Per step the PS asks for the forward half (the client answers with the activations at the cut and the
labels), then sends the gradient at the cut (the client finishes backward, clips with the global norm
and steps its own AdamW). The client half and its optimizer live only here.

It reads the job's data (or its own, `cleave worker --data`) with the job's tokenizer, fetched from the PS's
bundle (`cleave.models.bundles`).

The state is kept per job (not per PS incarnation), with a copy of it from before the last step applied: a
PS that restarts resumes at its last committed step + 1, which is the client's next step or the one it
has just applied; in that case the client goes back one step, and the run goes on exactly as if the PS had
not died. A client that lost its state (a restarted worker) cannot rejoin after step 0.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from cleave import codec
from cleave.errors import JobRefused
from cleave.methods import split
from cleave.methods.common import make_adamw, shard_batch, val_batches
from cleave.models import build_model
from cleave.schemas import SplitReply, SplitTask
from cleave.train.data import Corpus
from cleave.train.job import JobConfig
from cleave.train.schedule import set_lr
from cleave_worker.local_rounds import job_for_worker, own_corpus


@dataclass
class ClientState:
    job: JobConfig
    client: split.SplitClient
    corpus: Corpus
    next_step: int = 0  # the step whose forward comes next
    before: tuple[dict[str, Any], dict[str, Any]] | None = None  # half and optimizer before the last step

    def rewind(self, step: int) -> None:
        """Be ready for `step`'s forward: the next step, or the one just applied (then go back one step)."""
        if step == self.next_step:
            return
        if step == self.next_step - 1 and self.before is not None:
            self.client.half.load_state_dict(self.before[0])
            self.client.opt.load_state_dict(self.before[1])
            self.next_step, self.before = step, None
            log.info("split_step_rewound", job=self.job.job_id, step=step)
            return
        raise RuntimeError(f"this client is at step {self.next_step} of job {self.job.job_id}: it cannot run "
                           f"step {step}")

    def apply(self, back: split.CutBackward, step: int) -> float:
        """Finish `step` on the client (its backward and AdamW step), keeping the state from before it."""
        if step != self.next_step:
            raise RuntimeError(f"backward of step {step} while this client expects step {self.next_step}")
        half = {k: v.detach().clone() for k, v in self.client.half.state_dict().items()}
        self.before = (half, copy.deepcopy(self.client.opt.state_dict()))
        set_lr(self.client.opt, self.job, step)
        coef = self.client.backward(back)
        self.next_step = step + 1
        return coef


log = structlog.get_logger("worker")


class SplitRunner:
    def __init__(self, worker_id: str, data: str | None = None) -> None:
        self.worker_id, self.data = worker_id, data
        self.state: dict[str, ClientState] = {}

    def _client(self, task: SplitTask, tokenizer: Path | None) -> ClientState:
        key = f"{task.job}.{hashlib.sha256(task.job_config.encode()).hexdigest()[:16]}"
        if key not in self.state:
            if task.step != 0 or task.phase != "forward":
                raise RuntimeError(f"this client holds no state for job {task.job}: it cannot join at step {task.step}")
            job: JobConfig = job_for_worker(task.job_config, None, tokenizer)
            if job.own_data and not self.data:
                raise JobRefused(f"job {job.job_id!r} trains only on its client's own data and this worker declared "
                              "none (cleave worker --data SOURCE)")
            half, _ = split.split_model(build_model(job.arch(), seed=job.seed), task.split_layers)
            client = split.SplitClient(half, make_adamw(half.parameters(), job), job.grad_clip)
            self.state = {key: ClientState(job, client, own_corpus(job, self.data, job.arch().vocab_size))}
        return self.state[key]

    def run(self, task: SplitTask, tokenizer: Path | None = None) -> SplitReply:
        st = self._client(task, tokenizer)
        base = dict(job=task.job, epoch=task.epoch, step=task.step, phase=task.phase, worker_id=self.worker_id)
        if task.phase == "eval":  # the validation batches after this step, concatenated: (n*B, T, C)
            x, y = (torch.cat(t) for t in zip(*val_batches(st.corpus, st.job, task.step), strict=True))
            cut = st.client.evaluate(x)
            tied = None if cut.tied_weight is None else codec.tensor_to_data(cut.tied_weight)
            return SplitReply(**base, activations=codec.tensor_to_data(cut.activations), tied_weight=tied,
                              targets=codec.tensor_to_data(y))
        if task.phase == "forward":
            st.rewind(task.step)
            x, y = shard_batch(st.corpus, st.job, 0, task.step)
            cut = st.client.forward(x)
            tied = None if cut.tied_weight is None else codec.tensor_to_data(cut.tied_weight)
            return SplitReply(**base, activations=codec.tensor_to_data(cut.activations), tied_weight=tied,
                              targets=codec.tensor_to_data(y))
        back = split.CutBackward(
            loss=task.loss, grad=codec.data_to_tensor(task.grad),
            tied_grad=None if task.tied_grad is None else codec.data_to_tensor(task.tied_grad),
            grad_sq_norm=task.grad_sq_norm,
        )
        return SplitReply(**base, clip_coef=st.apply(back, task.step))


