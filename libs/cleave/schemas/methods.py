"""The messages of the round methods (DiLoCo, FedAvg: a round's task and each update) and of split learning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cleave.schemas.base import PackedTensors, TensorData, Wire
from cleave.schemas.limits import MAX_ROUND_WORKERS


class RoundTask(Wire):
    """Start round `round` of a data-parallel method: load `weights`, train `local_steps` steps, reply."""

    job: str
    epoch: int
    method: Literal["diloco", "fedavg"]
    round: int
    job_config: str  # the JobConfig JSON: model, optimizer, data, compression, LoRA
    weights: PackedTensors  # the global trainable parameters (lossless)
    shard: int = 0  # which slice of the job's data this worker trains on (0: the reference run's batches)
    reply: str  # where the update goes; "{worker_id}" in it stands for the answering worker's id
    # broadcast (SUBJECT_ROUNDCAST): the round's workers and each one's shard; a worker not named ignores it
    shards: dict[str, int] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)


class RoundUpdate(Wire):
    job: str
    epoch: int
    round: int
    worker_id: str
    delta: PackedTensors | None = None  # pseudo-gradient (diloco) or weight delta (fedavg), compressed
    weight: float = 0.0  # tokens or samples trained on: the aggregation weight
    losses: tuple[float, ...] = ()
    raw_bytes: int = 0  # the delta's size before compression
    error: str = ""


class SplitTask(Wire):
    """Split learning, PS -> client. `forward`: run the client half on batch `step` and send the cut.
    `backward`: here is the gradient at the cut; finish the step and send the clip coefficient.
    `eval`: the cut (and labels) of the validation batches after step `step`, nothing trained (val_every)."""

    job: str
    epoch: int
    step: int
    phase: Literal["forward", "backward", "eval"]
    job_config: str
    split_layers: int = Field(ge=0)
    reply: str
    grad: TensorData | None = None
    tied_grad: TensorData | None = None
    grad_sq_norm: float = 0.0
    loss: float = 0.0


class SplitReply(Wire):
    job: str
    epoch: int
    step: int
    phase: Literal["forward", "backward", "eval"]
    worker_id: str
    activations: TensorData | None = None
    tied_weight: TensorData | None = None
    targets: TensorData | None = None  # the labels: the server half computes the loss
    clip_coef: float = 1.0
    error: str = ""
