"""`init_from` a Hugging Face directory whose shape matches no preset: the architecture comes from its
config.json, and distributed training from it equals the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.errors import ConfigError
from cleave.models import PRESETS
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import InProcessPS, assert_same, start_fleet

transformers = pytest.importorskip("transformers")


def hf_dir(tmp_path: Path, family: str) -> Path:
    """A randomly initialised transformers model, saved as safetensors, with shapes no preset has."""
    torch.manual_seed(3)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=1, n_head=3, n_embd=48, vocab_size=300, n_positions=32)
        model = transformers.GPT2LMHeadModel(cfg)
    else:  # grouped-query attention and Llama 3 rope scaling
        cfg = transformers.LlamaConfig(
            hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=80,
            num_hidden_layers=2, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16, "rope_theta": 500000.0},
        )
        model = transformers.LlamaForCausalLM(cfg)
    out = tmp_path / family
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
async def test_init_from_a_directory_no_preset_fits_trains_as_the_reference(tmp_path, nats_url, family):
    path = hf_dir(tmp_path, family)
    job = JobConfig(init_from=str(path), steps=3, batch_size=2, seq_len=16)
    arch = job.arch()
    assert job.preset is None and arch.family == family and arch.vocab_size == 300
    assert all(arch != p for p in PRESETS.values())
    if family == "llama":
        assert arch.kv_heads == 2 and arch.rope_scaling is not None and arch.rope_theta == 500000.0
    reference = Trainer(job)
    want = [reference.step(s) for s in range(job.steps)]
    fleet = start_fleet(tmp_path / "fleet", nats_url, workers=2)
    try:
        async with InProcessPS(nats_url) as ps:
            await ps.wait_workers(2)
            dist = Trainer(job, ps.backend)
            got = [await ps.step(lambda s=s: dist.step(s), s) for s in range(job.steps)]
    finally:
        fleet.stop()
    assert_same(got, want)


def test_with_a_preset_a_mismatch_stays_an_error(tmp_path):
    path = hf_dir(tmp_path, "gpt2")
    with pytest.raises(ConfigError, match=r"does not fit preset='tiny': vocab_size is 300 there"):
        Trainer(JobConfig(preset="tiny", init_from=str(path), batch_size=2, seq_len=16))
