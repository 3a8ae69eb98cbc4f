"""The worker's side of split learning: it keeps the embedding, the first k blocks and its data.

Per step the PS asks for the forward half (the client answers with the activations at the cut and the
labels), then sends the gradient at the cut (the client finishes backward, clips with the global norm
and steps its own AdamW). The client half and its optimizer live only here.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave import codec
from cleave.data import Corpus
from cleave.job import JobConfig
from cleave.methods import split
from cleave.methods.common import make_adamw, shard_batch
from cleave.models import build_model, get_preset
from cleave.schemas import SplitReply, SplitTask


@dataclass
class ClientState:
    job: JobConfig
    client: split.SplitClient
    corpus: Corpus


class SplitRunner:
    def __init__(self, worker_id: str, data: str | None = None) -> None:
        self.worker_id, self.data = worker_id, data
        self.state: dict[str, ClientState] = {}

    def _client(self, task: SplitTask) -> ClientState:
        key = f"{task.job}.{task.epoch}"
        if key not in self.state:
            if task.step != 0 or task.phase != "forward":
                raise RuntimeError(f"this client holds no state for job {task.job}: it cannot join at step {task.step}")
            job = JobConfig.model_validate_json(task.job_config)
            half, _ = split.split_model(build_model(get_preset(job.preset), seed=job.seed), task.split_layers)
            client = split.SplitClient(half, make_adamw(half.parameters(), job), job.grad_clip)
            self.state = {key: ClientState(job, client, Corpus(self.data or job.data, job.val_fraction))}
        return self.state[key]

    def run(self, task: SplitTask) -> SplitReply:
        st = self._client(task)
        base = dict(job=task.job, epoch=task.epoch, step=task.step, phase=task.phase, worker_id=self.worker_id)
        if task.phase == "forward":
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
        return SplitReply(**base, clip_coef=st.client.backward(back))


