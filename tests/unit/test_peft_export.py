"""A LoRA job's export: the merged model loads in transformers, and the PEFT adapter loaded onto its base by
`peft` computes the same logits (GPT-2's Conv1D and Llama's linear projections; default and chosen targets)."""

from __future__ import annotations

import json

import pytest
import torch

from cleave.methods import lora
from cleave.methods.export import export, job_model
from cleave.train.job import JobConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.arange(40).reshape(2, 20) * 7 % 256


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21 on transformers 5
@pytest.mark.parametrize("preset,targets", [("tiny", ()), ("tiny-llama", ("q_proj", "v_proj"))])
def test_merged_export_and_peft_adapter_give_the_adapted_models_logits(tmp_path, preset, targets):
    job = JobConfig(preset=preset, method="fedavg", lora_rank=4, lora_alpha=8.0, lora_targets=targets)
    model = job_model(job)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.normal_(0, 0.5)  # trained adapters: far from the base
        want = model(TOKENS)
    out = export(model, job, job.arch(), tmp_path / "hf")
    merged_dir, adapter_dir, base_dir = out
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8.0, preset == "tiny")
    assert set(config["target_modules"]) == (set(targets) or {"c_attn", "c_proj", "c_fc"})
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        got_merged, got_peft = merged(TOKENS).logits, adapted(TOKENS).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir)(TOKENS).logits
    torch.testing.assert_close(got_merged, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(got_peft, got_merged, rtol=0, atol=1e-4)
    assert (plain - want).abs().max() > 1e-2  # the adapters matter: the base alone differs
