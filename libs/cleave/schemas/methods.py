"""The messages of the round methods (DiLoCo, FedAvg: a round's task and each update) and of split learning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cleave.schemas.base import PackedTensors, TensorData, Wire
from cleave.schemas.limits import MAX_ROUND_WORKERS


class SecAggKeys(Wire):
    """A member's two X25519 public keys for one round of secure aggregation (cleave.methods.secagg)."""

    c_pk: bytes = Field(min_length=32, max_length=32)  # to encrypt shares to this member
    s_pk: bytes = Field(min_length=32, max_length=32)  # to agree pairwise masks


class SecAggTask(Wire):
    """PS -> one member, a phase of secure aggregation (SUBJECT_SECAGG). `share`: here are the round's keys and
    the threshold, send your encrypted shares; `mask`: here are the shares sent to you and the members (U2),
    send your masked update; `reveal`: these members' inputs arrived (U3), those dropped: send the shares."""

    job: str
    epoch: int
    round: int
    session: str = Field(max_length=64)  # the round's attempt: keys are never reused
    phase: Literal["share", "mask", "reveal"]
    threshold: int = Field(0, ge=0)
    keys: dict[str, SecAggKeys] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)
    ciphertexts: dict[str, bytes] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)
    members: tuple[str, ...] = Field((), max_length=MAX_ROUND_WORKERS)
    dropped: tuple[str, ...] = Field((), max_length=MAX_ROUND_WORKERS)


class SecAggReply(Wire):
    """Member -> PS inside its RoundUpdate: its keys, its encrypted shares (by recipient), that its masked update
    is this message's delta, or its revealed shares (of self-mask seeds by survivor, of keys by dropped member)."""

    session: str = Field(max_length=64)
    phase: Literal["keys", "shares", "masked", "reveal"]
    keys: SecAggKeys | None = None
    ciphertexts: dict[str, bytes] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)
    b_shares: dict[str, bytes] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)
    s_shares: dict[str, bytes] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)


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
    # the job's base weights (init_from) and tokenizer as published by the PS (cleave.models.bundles); "": none
    base_bundle: str = Field("", max_length=64)
    tokenizer_bundle: str = Field("", max_length=64)
    session: str = Field("", max_length=64)  # secure aggregation's session for this round ("": plain updates)


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
    data_tokens: int = 0  # the size of the sender's own training data (--data), in tokens; 0: it has none
    refused: bool = False  # with `error`: this worker cannot take part in this job at all (no own data, no memory)
    secagg: SecAggReply | None = None  # secure aggregation: a phase's message (`delta`: the masked update)


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
    tokenizer_bundle: str = Field("", max_length=64)  # the job's tokenizer as published by the PS; "": none


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
