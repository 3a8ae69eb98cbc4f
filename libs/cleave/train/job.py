"""A training job's description: one typed config shared by the CLI, the PS and the reference run."""

from __future__ import annotations

import difflib
import functools
import secrets
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cleave.errors import ConfigError
from cleave.models import PRESETS, ModelConfig, StepLayout, gemm_shapes, get_preset
from cleave.models.gemms import DEFAULT_LOGITS_BYTES
from cleave.models.hf import own_tokenizer, read_hf_config
from cleave.models.tokenizer import recorded_spec
from cleave.runtime import config_file
from cleave.schemas.jobs import JOB_ID_PATTERN
from cleave.train.sources import recorded_source

DEFAULT_PRESET = "tiny"
PATH_SETTINGS = ("init_from", "tokenizer", "data")  # local paths, read where the PS runs


def absolute_spec(name: str, spec: str | None) -> str | None:
    """The setting `name` of `PATH_SETTINGS` with a local path made absolute, from this process's folder."""
    if spec is None:
        return None
    return recorded_source(spec) if name == "data" else recorded_spec(spec)


def located(job: JobConfig) -> str:
    """`job` (JSON) as the PS records it with its state: its local paths absolute, so that the job resumed from
    another folder names the same files (and other files of the same name there are another job), and an
    export reads its tokenizer from anywhere. The job itself keeps them as given: a worker reads the job's data
    from its own folder."""
    return job.model_copy(update={k: absolute_spec(k, getattr(job, k)) for k in PATH_SETTINGS}).model_dump_json()


@functools.lru_cache(maxsize=8)
def _hf_config(path: str) -> ModelConfig:
    return read_hf_config(path)

ROUND_METHODS = ("diloco", "fedavg")
# A setting -> the methods it applies to. Under any other method a value other than its default is refused
# at parse time (it would be silently ignored). A new method-specific setting needs one line here.
METHOD_SETTINGS: dict[str, tuple[str, ...]] = {
    "split_layers": ("split",),
    "local_steps": ROUND_METHODS,
    "outer_lr": ("diloco",),
    "outer_momentum": ("diloco",),
    "aggregate": ROUND_METHODS,
    "compress": ROUND_METHODS,
    "lora_rank": ROUND_METHODS,
    "lora_alpha": ROUND_METHODS,
    "lora_targets": ROUND_METHODS,
    "round_timeout_s": (*ROUND_METHODS, "split"),
    "max_staleness": ROUND_METHODS,
    "min_updates": ROUND_METHODS,
    "init_from": ("cleave", *ROUND_METHODS),
    "precision": ("cleave", *ROUND_METHODS),  # split's client runs its own layers in fp32
    "recompute": ("cleave",),  # the PS's activation memory (the round methods' models live on the workers)
    "micro_batches": ("cleave",),
    "logits_bytes": ("cleave",),
    "own_data": (*ROUND_METHODS, "split"),
    "update_clip": ROUND_METHODS,
    "max_empty_rounds": ROUND_METHODS,
    "secagg": ("fedavg",),
    "dp_noise": ("fedavg",),
    "dp_delta": ("fedavg",),
}
# A setting -> (another setting, a test on it, what the test says): the first only applies when it holds
SETTING_NEEDS = {
    "lora_alpha": ("lora_rank", lambda v: v > 0, "lora_rank > 0"),
    "lora_targets": ("lora_rank", lambda v: v > 0, "lora_rank > 0"),
    "dp_delta": ("dp_noise", lambda v: v > 0, "dp_noise > 0"),
    "val_every": ("val_fraction", lambda v: v > 0, "val_fraction > 0 (a validation split to evaluate on)"),
}

# diloco and fedavg defaults, measured on `small` (benchmarks/diloco_grid.py); the same in cleave.methods
DEFAULT_LOCAL_STEPS = 10
DEFAULT_OUTER_LR = 1.0
DEFAULT_OUTER_MOMENTUM = 0.0
DEFAULT_MAX_EMPTY_ROUNDS = 4  # rounds in a row with no accepted update before the job fails (each is redone, after
# 2, 4, 8 s: a fleet whose heartbeats were late on a loaded machine gets about 14 s to come back)
DEFAULT_DP_DELTA = 1e-5  # the delta of the (epsilon, delta) the privacy accountant reports


def new_job_id(kind: str) -> str:
    """Unique per job made: persisted state belongs to a job id, and a new job must not resume an old one."""
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class JobConfig(BaseModel):
    # strict: `steps = true` or `lr = "0.1"` is an error, not 1 or 0.1 (a TOML or JSON job's types are its own);
    # no inf or nan (inf would be written as null)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)

    job_id: str = Field(default_factory=lambda: new_job_id("job"), pattern=JOB_ID_PATTERN)  # new for every job made
    method: Literal["cleave", "diloco", "fedavg", "split"] = "cleave"  # for diloco/fedavg, steps count rounds
    split_layers: int = Field(1, ge=0)  # split learning: blocks the client keeps after the embedding
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where the PS (or the reference run) computes
    # the GEMMs' precision (cleave.train.precision): bf16/fp16 as torch.autocast, fp32 master weights and optimizer
    # state, input blocks on the wire in 2 bytes; fp16 adds dynamic loss scaling (GradScaler's rules)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    local_steps: int = Field(DEFAULT_LOCAL_STEPS, ge=1)  # diloco's H / fedavg's E: local steps per round
    outer_lr: float = Field(DEFAULT_OUTER_LR, gt=0)  # diloco's outer step (see docs/methods.md for the grid)
    outer_momentum: float = Field(DEFAULT_OUTER_MOMENTUM, ge=0, lt=1)  # and its Nesterov momentum
    aggregate: Literal["mean", "median", "trimmed"] = "mean"  # how a round's updates are combined
    compress: str = "none"  # what travels up: none, fp16, bf16, int8[:BLOCK], topk:FRACTION
    lora_rank: int = Field(0, ge=0)  # > 0: only LoRA adapters of this rank train and travel
    lora_alpha: float = Field(16.0, gt=0)  # the adapters' output is scaled by lora_alpha / lora_rank (as PEFT's)
    # the projections that get adapters, by module name; empty: attention and MLP (cleave.methods.lora)
    lora_targets: tuple[str, ...] = Field((), max_length=64, strict=False)  # (a JSON or TOML list)
    round_timeout_s: float = Field(120.0, gt=0)  # a round closes with what arrived by then
    max_staleness: int = Field(0, ge=0)  # late updates up to this many rounds old count, weight 1/(1+age)
    min_updates: int = Field(0, ge=0)  # a round closes once this many arrived (0: every worker of the plan)
    max_empty_rounds: int = Field(DEFAULT_MAX_EMPTY_ROUNDS, ge=1)  # a round with no accepted update is redone;
    # after this many in a row the job fails (exit status 4) with what it saw
    update_clip: float = Field(0.0, ge=0)  # > 0: every update's L2 norm is clipped to this before it is combined
    own_data: bool = False  # every member trains on the data it declared (`cleave worker --data`); one without is refused
    secagg: bool = False  # pairwise-masked aggregation: the PS learns only the sum of the members' updates
    dp_noise: float = Field(0.0, ge=0)  # > 0: client-level DP, Gaussian noise of std dp_noise x update_clip on the sum
    dp_delta: float = Field(DEFAULT_DP_DELTA, gt=0, lt=1)  # the accountant reports epsilon at this delta
    preset: str | None = None  # a name from cleave.models.PRESETS; None: init_from's config.json, else "tiny"
    steps: int = Field(20, ge=1)
    batch_size: int = Field(8, ge=1)
    # activation checkpointing per layer: keep each block's input, run its forward again (its GEMMs dealt again)
    # in the backward; None: on only when the batch would not fit the PS's memory without it (the preflight)
    recompute: bool | None = None
    micro_batches: int = Field(1, ge=1)  # the batch in this many equal parts, gradients accumulated
    logits_bytes: int = Field(DEFAULT_LOGITS_BYTES, ge=1)  # the head and loss run in chunks of tokens whose
    # float32 logits take at most this (cleave.gemm.head); smaller: less memory, the head's dW sent back more often
    seq_len: int | None = Field(None, ge=2)  # None = the preset's block_size
    lr: float = Field(2e-3, gt=0)  # the peak learning rate (cleave.train.schedule)
    lr_schedule: Literal["cosine", "constant"] = "cosine"  # cosine: linear warmup, then cosine decay to lr_min
    warmup_steps: int | None = Field(None, ge=0)  # None: 5% of the optimizer steps, at most 2000
    lr_min: float | None = Field(None, ge=0)  # the floor of the decay; None: lr / 10 (nanoGPT's min_lr)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)  # AdamW's betas (torch refuses others, but only once it builds one)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 turns clipping off
    seed: int = Field(0, ge=0, lt=2**32)  # (the data's generators are seeded with seed x 1,000,003 + step)
    data: str = "builtin"  # "builtin", a file, folder, glob, JSONL, hf:... or tokens: see cleave.train.sources
    # random: each batch's windows drawn anew (with replacement); epochs: every example (or window) once per epoch
    # in a shuffled order. Instruction data (prompt/response, chat messages) is always read in epochs.
    sampling: Literal["random", "epochs"] = "random"
    tokenizer: str = Field("bytes", min_length=1)  # "bytes", or a spec for cleave.models.tokenizer.load_tokenizer
    val_fraction: float = Field(0.1, ge=0, lt=1)
    val_every: int = Field(0, ge=0)  # evaluate val_loss every N steps; 0 = never
    init_from: str | None = Field(None, min_length=1)  # a Hugging Face model dir to start from (fine-tuning)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: object) -> object:
        """No preset and no init_from: the default preset. init_from without a tokenizer: the model's own (a BPE
        model fine-tuned on byte ids trained, silently, on the wrong tokens)."""
        if isinstance(data, dict) and data.get("preset") is None and data.get("init_from") is None:
            return {**data, "preset": DEFAULT_PRESET}
        if isinstance(data, dict) and data.get("init_from") and data.get("tokenizer") is None:
            own = own_tokenizer(data["init_from"])
            return {**data, "tokenizer": own} if own else data
        return data

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        self._check_settings_apply()  # first: a setting the method ignores is the error to report
        if self.preset is not None and self.preset not in PRESETS:
            close = difflib.get_close_matches(self.preset.lower(), PRESETS, n=1)
            raise ValueError(f"preset={self.preset!r} is unknown" + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; choose one of {', '.join(PRESETS)}")
        try:
            arch = self.arch()
        except ConfigError as e:
            raise ValueError(str(e)) from None
        block = arch.block_size
        if self.method == "split" and not 0 <= self.split_layers <= arch.n_layer:  # (also what --reference trains)
            raise ValueError(f"split_layers={self.split_layers} must be between 0 and the model's "
                             f"n_layer={arch.n_layer}")
        if self.lora_targets:  # (named by the last part of a linear layer's name, as `methods.lora` matches them)
            # (never the head: its loss runs in chunks of its weight, and a tied head is the input embedding)
            linears = {g.name.split(".")[-2] for g in gemm_shapes(arch, 1, 1)} - {"lm_head"}
            unknown = [t for t in self.lora_targets if t not in linears]
            if "lm_head" in unknown:
                raise ValueError("lora_targets cannot name lm_head: LoRA adapts the blocks' linear layers "
                                 f"({', '.join(sorted(linears))})")
            if unknown:
                raise ValueError(f"lora_targets {', '.join(map(repr, unknown))} name no linear layer of the model; "
                                 f"it has {', '.join(sorted(linears))}")
        if self.seq_len is not None and self.seq_len > block:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's block_size={block}")
        if self.lr_min is not None and self.lr_min > self.lr:
            raise ValueError(f"lr_min={self.lr_min} is above lr={self.lr}: the decay's floor must be at most its peak")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"micro_batches={self.micro_batches} must divide batch_size={self.batch_size}")
        if self.compress != "none":
            from cleave.compression import get_compressor  # noqa: PLC0415 - compression imports torch

            try:
                get_compressor(self.compress)
            except ConfigError as e:  # (a ValidationError naming the setting, as every other one)
                raise ValueError(f"compress={self.compress!r}: {e}") from None
        self._check_privacy()
        return self

    def _check_privacy(self) -> None:
        """Secure aggregation sees only the sum, and DP's noise is calibrated to a clipped update."""
        if self.secagg:
            wrong = [f"{k}={getattr(self, k)!r}" for k, ok in (("aggregate", "mean"), ("compress", "none"),
                                                              ("max_staleness", 0)) if getattr(self, k) != ok]
            if wrong:
                raise ValueError(f"secagg needs aggregate='mean', compress='none' and max_staleness=0 (the PS sees "
                                 f"only the sum of one round's updates); it has {', '.join(wrong)}")
        if self.dp_noise > 0 and (self.update_clip <= 0 or self.aggregate != "mean" or self.max_staleness):
            raise ValueError("dp_noise > 0 needs update_clip > 0 (the noise is calibrated to the clipped update), "
                             f"aggregate='mean' and max_staleness=0; it has update_clip={self.update_clip}, "
                             f"aggregate={self.aggregate!r}, max_staleness={self.max_staleness}")

    def _check_settings_apply(self) -> None:
        """Refuse a setting (not at its default) that the job's method, or another setting, would ignore."""
        wrong = [f"{name}={getattr(self, name)!r} does not apply to method={self.method!r}: "
                 f"it needs method {' or '.join(methods)}"
                 for name, methods in METHOD_SETTINGS.items()
                 if self.method not in methods and getattr(self, name) != type(self).model_fields[name].default]
        if wrong:
            raise ValueError("; ".join(wrong))
        for name, (other, holds, says) in SETTING_NEEDS.items():
            value = getattr(self, name)
            if value != type(self).model_fields[name].default and not holds(getattr(self, other)):
                raise ValueError(f"{name}={value!r} has no effect unless {says}")

    def arch(self) -> ModelConfig:
        """The architecture: the preset's, or (no preset) the one in init_from's config.json."""
        if self.preset is not None:
            return get_preset(self.preset)
        return _hf_config(self.init_from)

    @property
    def model_name(self) -> str:
        """What to call the model in messages: the preset, or the directory it comes from."""
        return self.preset or f"init_from={self.init_from}"

    @property
    def seq(self) -> int:
        return self.seq_len or self.arch().block_size

    def finished_at(self, step: int | None) -> bool:
        """Whether the job is done once step (or round) `step` is committed (None: none yet). A PS that exits 0
        short of that was stopped from outside: its supervisor starts it again, and it resumes."""
        return step is not None and step + 1 >= self.steps

    def layout(self, replicas: int = 1) -> StepLayout:
        """How one PS (of `replicas`, each with its share of the batch) runs a step's GEMMs; `recompute`
        still undecided (None) counts as off."""
        return StepLayout.of(self.arch(), self.batch_size // replicas // self.micro_batches * self.seq,
                             bool(self.recompute), self.micro_batches, self.logits_bytes)

    @classmethod
    def load(cls, path: str | Path, **overrides: object) -> JobConfig:
        """Read a job from a settings file (TOML, or JSON; cleave.runtime.config_file): its top-level keys, with
        `overrides` (e.g. from command-line flags) over them. An error names the file and the key."""
        raw = config_file.job_settings(path)
        try:
            return cls.build(**{**raw, **overrides})
        except ConfigError as e:
            given = " (or a flag given with it)" if overrides else ""
            raise ConfigError(f"{path}{given}: {e}") from None

    @classmethod
    def build(cls, **fields: object) -> JobConfig:
        try:
            return cls(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                close = difflib.get_close_matches(where, cls.model_fields, n=1)
                raise ConfigError(f"unknown job setting {where}" + (f" (did you mean {close[0]}?)" if close else
                                  "; the settings are listed in docs/user-guide.md")) from None
            raise ConfigError(f"invalid job setting {where}: {msg}" if where else f"invalid job: {msg}") from None
