"""A training job's description: one typed config shared by the CLI, the PS and the reference run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cleave.errors import ConfigError
from cleave.models import PRESETS

# diloco and fedavg defaults, measured on `small` (benchmarks/diloco_grid.py); the same in cleave.methods
DEFAULT_LOCAL_STEPS = 10
DEFAULT_OUTER_LR = 1.0
DEFAULT_OUTER_MOMENTUM = 0.0


class JobConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field("job", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    method: Literal["cleave", "diloco", "fedavg", "split"] = "cleave"  # for diloco/fedavg, steps count rounds
    split_layers: int = Field(1, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where the PS (or the reference run) computes  # split learning: blocks the client keeps after the embedding
    local_steps: int = Field(DEFAULT_LOCAL_STEPS, ge=1)  # diloco's H / fedavg's E: local steps per round
    outer_lr: float = Field(DEFAULT_OUTER_LR, gt=0)  # diloco's outer step (see docs/methods.md for the grid)
    outer_momentum: float = Field(DEFAULT_OUTER_MOMENTUM, ge=0, lt=1)  # and its Nesterov momentum
    aggregate: Literal["mean", "median", "trimmed"] = "mean"  # how a round's updates are combined
    compress: str = "none"  # what travels up: none, fp16, bf16, int8[:BLOCK], topk:FRACTION
    lora_rank: int = Field(0, ge=0)  # > 0: only LoRA adapters of this rank train and travel
    lora_alpha: float = Field(16.0, gt=0)
    round_timeout_s: float = Field(120.0, gt=0)  # a round closes with what arrived by then
    max_staleness: int = Field(0, ge=0)  # late updates up to this many rounds old count, weight 1/(1+age)
    min_updates: int = Field(0, ge=0)  # a round closes once this many arrived (0: every worker of the plan)
    preset: str = "tiny"  # a name from cleave.models.PRESETS
    steps: int = Field(20, ge=1)
    batch_size: int = Field(8, ge=1)
    seq_len: int | None = Field(None, ge=2)  # None = the preset's block_size
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = Field(1.0, ge=0)  # 0 turns clipping off
    seed: int = 0
    data: str = "builtin"  # "builtin", a file, folder, glob, JSONL, hf:... or tokens: see cleave.datasources
    tokenizer: str = Field("bytes", min_length=1)  # "bytes", or a spec for cleave.tokenizer.load_tokenizer
    val_fraction: float = Field(0.1, ge=0, lt=1)
    val_every: int = Field(0, ge=0)  # evaluate val_loss every N steps; 0 = never
    init_from: str | None = Field(None, min_length=1)  # a Hugging Face model dir to start from (fine-tuning)

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        block = PRESETS[self.preset].block_size
        if self.seq_len is not None and self.seq_len > block:
            raise ValueError(f"seq_len={self.seq_len} exceeds the preset's block_size={block}")
        return self

    @property
    def seq(self) -> int:
        return self.seq_len or PRESETS[self.preset].block_size

    @classmethod
    def load(cls, path: str | Path, **overrides: object) -> JobConfig:
        """Read a JSON job file; `overrides` (e.g. from command-line flags) win over the file."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read job config {path}: {e}") from None
        return cls.build(**{**raw, **overrides})

    @classmethod
    def build(cls, **fields: object) -> JobConfig:
        try:
            return cls(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "job"
            raise ConfigError(f"invalid job setting {where}: {first['msg']}") from None
