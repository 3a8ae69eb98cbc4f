"""A resumed run continues from the exact data position; `init_from` starts from a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave import codec
from cleave.errors import ConfigError
from cleave.models import build_model, get_preset
from cleave.models.hf import export_hf, load_hf
from cleave.models.tokenizer import ByteTokenizer
from cleave.schemas import CheckpointManifest
from cleave.train import sources
from cleave.train.checkpoint import encode, restore, snapshot
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

STEPS = 6


def resumed_losses(job: JobConfig, stop_after: int) -> list[float]:
    """Run steps [0, stop_after], persist as the PS does, restore into a fresh trainer, run to the end."""
    first = Trainer(job)
    losses = [first.step(s) for s in range(stop_after + 1)]
    data, manifest = encode(snapshot(first.model, first.opt, job.job_id, stop_after, epoch=1), chunk_bytes=4096)
    manifest = codec.decode(codec.encode(manifest), CheckpointManifest)  # through the wire format, as stored
    del first
    torch.manual_seed(12345)  # a new process: its RNG state is whatever it is until restored
    second = Trainer(job)
    restore(second.model, second.opt, data, manifest)
    return losses + [second.step(s) for s in range(manifest.step + 1, job.steps)]


@pytest.mark.parametrize("source", ["builtin", "tokens"])
def test_resumed_run_continues_from_the_exact_data_position(tmp_path: Path, source: str) -> None:
    data = "builtin"
    if source == "tokens":
        data = str(tmp_path / "builtin.u16")
        sources.prepare_data("builtin", ByteTokenizer(), data)
    job = JobConfig(preset="tiny", steps=STEPS, batch_size=4, seq_len=32, data=data)
    plain = Trainer(job)
    want = [plain.step(s) for s in range(STEPS)]
    for stop_after in (0, 2, STEPS - 2):
        assert resumed_losses(job, stop_after) == want  # bit for bit: same batches, same state


def perturbed(preset: str, seed: int = 7) -> torch.nn.Module:
    model = build_model(get_preset(preset), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def test_init_from_loads_every_weight(tmp_path: Path) -> None:
    model = perturbed("tiny")
    export_hf(model, get_preset("tiny"), tmp_path / "m")
    trainer = Trainer(JobConfig(preset="tiny", batch_size=2, seq_len=16, init_from=str(tmp_path / "m")))
    got, want = trainer.model.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.isfinite(torch.tensor(trainer.step(0)))


def test_init_from_none_is_the_seeded_model() -> None:
    job = JobConfig(preset="tiny")
    want = build_model(get_preset("tiny"), seed=job.seed).state_dict()
    got = Trainer(job).model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_init_from_a_different_model_names_the_fields(tmp_path: Path) -> None:
    export_hf(perturbed("tiny-llama"), get_preset("tiny-llama"), tmp_path / "llama")
    with pytest.raises(
        ConfigError, match=r"init_from='.*llama' does not fit preset='tiny': family is 'llama' there"
    ):
        Trainer(JobConfig(preset="tiny", init_from=str(tmp_path / "llama")))
    export_hf(perturbed("tiny"), get_preset("tiny"), tmp_path / "tiny")
    with pytest.raises(ConfigError, match=r"n_layer is 2 there, 4 in the preset.*n_embd is 64 there, 128"):
        Trainer(JobConfig(preset="small", init_from=str(tmp_path / "tiny")))
    with pytest.raises(ConfigError, match="is not a directory"):
        Trainer(JobConfig(preset="tiny", init_from=str(tmp_path / "absent")))


def test_init_from_checks_keys_before_copying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory whose config fits but whose weights do not: nothing is copied."""
    export_hf(perturbed("tiny"), get_preset("tiny"), tmp_path / "m")
    cfg, sd = load_hf(tmp_path / "m")
    sd.pop("transformer.h.1.mlp.c_fc.bias")
    monkeypatch.setattr("cleave.train.trainer.load_hf", lambda path: (cfg, sd))
    with pytest.raises(ConfigError, match=r"missing keys: transformer.h.1.mlp.c_fc.bias"):
        Trainer(JobConfig(preset="tiny", init_from=str(tmp_path / "m")))
