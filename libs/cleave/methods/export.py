"""What a job's trained model is written as: a Hugging Face model directory, and for a LoRA job also its adapters.

`job_model(job)` builds the model a job's checkpoint holds (with the job's LoRA adapters, if any), for the
checkpoint to be read into. `export(model, job, out)` writes:
- `out`: the model as `transformers` loads it (`cleave.models.hf.export_hf`), LoRA adapters merged into the
  base weights (`merge_lora`), with the job's tokenizer files;
- for a LoRA job, `adapter_out` (default `out/adapter`): the adapters as a PEFT adapter directory
  (`cleave.models.peft`) for the job's base model (`init_from`). A LoRA job that started from the seed's
  weights, not a published base, gets that base written beside it (`adapter_out/base`), so the adapter
  always has the model it belongs to.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from cleave.methods.lora import LoRALinear, attach_for_job, lora_state, merge_lora
from cleave.models import ModelConfig, build_model
from cleave.models.hf import export_hf
from cleave.models.peft import write_adapter
from cleave.train.job import JobConfig

ADAPTER_DIR = "adapter"
BASE_DIR = "base"


def job_model(job: JobConfig) -> nn.Module:
    """The model a job's checkpoint holds: the architecture, and the job's adapters when it has any."""
    return attach_for_job(build_model(job.arch(), seed=0), job)  # every weight is overwritten by the checkpoint


def base_of(model: nn.Module) -> nn.Module:
    """A copy of an adapted model without its adapters (the frozen base weights)."""
    base = copy.deepcopy(model)
    with torch.no_grad():
        for m in base.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.zero_()
    return merge_lora(base)


def export(model: nn.Module, job: JobConfig, cfg: ModelConfig, out: str | Path, dtype: torch.dtype | None = None,
           adapter_out: str | Path | None = None, home: str | Path | None = None,
           adapter_home: str | Path | None = None) -> list[Path]:
    """Write the job's model (merged) to `out` and, for a LoRA job, its PEFT adapter; the directories written,
    where they will be found: `home` and `adapter_home`, the places `out` and `adapter_out` are moved to once
    written (a staging folder: `cleave.api.jobs.export`), by default where they are. The adapter names its base
    model by an absolute path (a local one: read from any working directory) or a repo id."""
    home = Path(home or out)
    if not job.lora_rank:
        export_hf(model, cfg, out, tokenizer_name=job.tokenizer, dtype=dtype)
        return [home]
    adapters = Path(adapter_out) if adapter_out else Path(out) / ADAPTER_DIR
    adapters_home = Path(adapter_home or adapter_out or home / ADAPTER_DIR)
    written = [home, adapters_home]
    base = job.init_from or ""
    if not base:
        export_hf(base_of(model), cfg, adapters / BASE_DIR, tokenizer_name=job.tokenizer, dtype=dtype)
        base = str((adapters_home / BASE_DIR).resolve())
        written.append(adapters_home / BASE_DIR)
    elif Path(base).is_dir():
        base = str(Path(base).resolve())
    write_adapter(adapters, cfg, lora_state(model), job.lora_rank, job.lora_alpha, base)
    export_hf(merge_lora(model), cfg, out, tokenizer_name=job.tokenizer, dtype=dtype)
    return written
