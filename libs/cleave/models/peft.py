"""LoRA adapters as a PEFT adapter directory: `adapter_config.json` + `adapter_model.safetensors`.

`peft.PeftModel.from_pretrained(base, directory)` loads it onto the Hugging Face base model and computes what
the adapted model computed here: our `LoRALinear` adds `(alpha / rank) · B·A·x` with A (rank, in) and B (out,
rank), which is PEFT's LoRA on a linear layer (and on GPT-2's Conv1D, whose weight PEFT reads transposed:
`fan_in_fan_out`). Keys are the Hugging Face module paths under PEFT's `base_model.model.` prefix, the adapter
name left out, as PEFT saves them. Needs torch and safetensors, never peft.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from cleave.errors import ConfigError
from cleave.models.config import ModelConfig
from cleave.models.hf import _hf_key, _safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
SUFFIXES = (".lora_A", ".lora_B")


def peft_key(cfg: ModelConfig, key: str) -> str:
    """Our adapter key (`transformer.h.0.attn.c_attn.lora_A`) -> PEFT's (`base_model.model.transformer.h.0.attn.
    c_attn.lora_A.weight`); Llama's modules get the `model.` prefix of `LlamaForCausalLM`."""
    module, _, which = key.rpartition(".")
    if which not in ("lora_A", "lora_B"):
        raise ConfigError(f"{key} is not a LoRA adapter tensor")
    hf_module = _hf_key(cfg, f"{module}.weight").removesuffix(".weight")
    return f"{PEFT_PREFIX}{hf_module}.{which}.weight"


def adapter_config(cfg: ModelConfig, rank: int, alpha: float, targets: Sequence[str], base: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "fan_in_fan_out": cfg.family == "gpt2",  # GPT-2's projections are Conv1D (weights stored transposed)
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter(out_dir: str | Path, cfg: ModelConfig, adapters: Mapping[str, torch.Tensor], rank: int,
                  alpha: float, base: str = "") -> Path:
    """Write `adapters` (our `...lora_A` / `...lora_B` tensors) as a PEFT adapter directory for the base model
    `base` (a directory or repo id; recorded, not read)."""
    if not adapters:
        raise ConfigError("no LoRA adapters to write: the model has none")
    bad = sorted(k for k in adapters if not k.endswith(SUFFIXES))
    if bad:
        raise ConfigError(f"not LoRA adapter tensors: {bad[:3]}")
    targets = {k.rpartition(".")[0].rpartition(".")[2] for k in adapters}  # the adapted modules' own names
    tensors = {peft_key(cfg, k): t.detach().to("cpu", torch.float32).contiguous() for k, t in adapters.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _safetensors().save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, rank, alpha, targets, base), indent=2) + "\n")
    (out / ADAPTER_WEIGHTS).chmod((out / ADAPTER_CONFIG).stat().st_mode & 0o777)  # (safetensors wrote it 0600)
    return out
