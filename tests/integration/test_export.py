"""`cleave export` of a real distributed run, loaded by `transformers`; and a run started from the export."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cleave.api import jobs, state
from cleave.api.stack import Stack
from cleave.errors import CleaveError, ConfigError
from cleave.methods import export as methods_export
from cleave.schemas import STATE_OBJECTS
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_cli import export_cmd
from tests.integration.fleet import assert_same

JOB_ID = "export-test"
STEPS = 3
TOKENS = torch.arange(48).reshape(2, 24) * 5 % 256  # (B, T) byte ids


def cleave(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "cleave_cli", *argv], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export(run_dir: Path, out: Path, *extra: str) -> None:
    """`cleave export ...` through the command's own parser and entry point."""
    parser = argparse.ArgumentParser()
    export_cmd.register(parser.add_subparsers(dest="command"))
    assert (
        export_cmd.run(parser.parse_args(["export", "--run-dir", str(run_dir), "--out", str(out), *extra]))
        == 0
    )


def checkpoint_model(run_dir: Path) -> tuple[int, torch.nn.Module]:
    """Our model with the run's last committed checkpoint, read straight from its JetStream store."""
    with state.state_server(run_dir) as url:
        head, _, _, model = asyncio.run(state.read_state(url, JOB_ID))
    return head.step, model


def hf_logits(path: Path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("export") / "run"
    cleave(
        "train",
        "--preset",
        "tiny",
        "--steps",
        str(STEPS),
        "--workers",
        "2",
        "--run-dir",
        str(d),
        "--job-id",
        JOB_ID,
    )
    return d


def test_export_after_the_stack_stopped(run_dir: Path, tmp_path: Path) -> None:
    stack = json.loads((run_dir / "stack.json").read_text())
    assert not any(p["running"] for p in stack["processes"])  # `cleave train` stopped its stack
    export(run_dir, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "hf" / "cleave_tokenizer.json").read_text())["tokenizer"] == "bytes"
    step, ours = checkpoint_model(run_dir)
    assert step == STEPS - 1
    with torch.no_grad():
        want = ours(TOKENS)
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), want, rtol=0, atol=1e-5)
    # and it is the trained model: the single-process reference's weights after the same steps
    reference = Trainer(JobConfig(job_id=JOB_ID, preset="tiny", steps=STEPS))
    for s in range(STEPS):
        reference.step(s)
    with torch.no_grad():
        torch.testing.assert_close(want, reference.model(TOKENS), rtol=0, atol=1e-3)
        untrained = Trainer(JobConfig(preset="tiny")).model(TOKENS)
    assert (want - untrained).abs().max() > 1e-2


def test_a_stack_is_refused_on_a_run_dir_while_an_export_reads_its_store(run_dir: Path) -> None:
    """An export of a stopped run starts a nats-server of its own on the run's store: a resume started then
    shared that store with it. The run dir is held meanwhile; a stack there is refused, and taken once done."""
    from cleave.api.fleet import LocalFleet
    from cleave.api.stack import hold

    refused = rf"{run_dir} is in use: another cleave \(pid {os.getpid()}\)"
    with state.state_server(run_dir), pytest.raises(CleaveError, match=refused):
        LocalFleet(run_dir, 0)
    os.close(hold(run_dir))  # (free again)


def test_export_from_the_running_stack(run_dir: Path, tmp_path: Path) -> None:
    stack = Stack(run_dir)
    stack.start_nats()  # the run's store served again, recorded in stack.json as a live stack would be
    try:
        assert state.running_nats(run_dir) == stack.nats_url
        export(run_dir, tmp_path / "hf", "--job-id", JOB_ID, "--dtype", "bfloat16")
    finally:
        stack.stop_all()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["model_type"] == "gpt2"
    _, ours = checkpoint_model(run_dir)
    with torch.no_grad():
        want = ours(TOKENS)
    torch.testing.assert_close(hf_logits(tmp_path / "hf").float(), want, rtol=0, atol=0.1)


def test_an_export_replaces_an_earlier_one_whole_and_one_that_fails_leaves_it(run_dir: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier export's files do not outlive it: a stale tokenizer.json won over the new model's tokenizer
    (transformers and `--tokenizer OUT` read it), a stale adapter/ was another job's. An export that fails
    midway (a full disk) leaves the earlier one as it was, and nothing beside it."""
    out = tmp_path / "hf"
    (out / "adapter").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "cleave_tokenizer.json", "adapter/adapter_config.json"):
        (out / name).write_text("{}")  # an earlier export of another job (BPE tokenizer, LoRA adapter)
    export(run_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["cleave_tokenizer.json", "config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~current_umask())}, modes  # (safetensors wrote the weights 0600)
    monkeypatch.chdir(out)
    export(run_dir, Path("."))  # over the export it is run in
    monkeypatch.chdir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(model, cfg, where, **kw) -> None:  # noqa: ANN001 - export_hf's arguments
        (Path(where) / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (Path(where) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(methods_export, "export_hf", full_disk)
    with pytest.raises(CleaveError, match="cannot write the export to .* No space left on device; nothing was"):
        jobs.export(out, run_dir=run_dir)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left
    with pytest.raises(ConfigError, match=r"adapter_out \(--adapter-out\) .* is the model's own folder"):
        jobs.export(out, run_dir=run_dir, adapter_out=out)
    with pytest.raises(ConfigError, match=f"job '{JOB_ID}' has no LoRA adapters"):  # (it was ignored)
        jobs.export(out, run_dir=run_dir, adapter_out=tmp_path / "adapter")


def test_a_store_without_its_checkpoints_is_named_not_a_traceback(run_dir: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "run"
    shutil.copytree(run_dir, damaged)
    (objects,) = damaged.glob(f"jetstream/jetstream/*/streams/OBJ_{STATE_OBJECTS}")
    shutil.rmtree(objects)
    with pytest.raises(CleaveError, match=f"holds the head of job '{JOB_ID}' .* but no checkpoint store"):
        jobs.export(tmp_path / "hf", run_dir=damaged)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # ~13 s (init_from itself: test_init_any_hf in the default run)
def test_train_starts_from_an_export(run_dir: Path, tmp_path: Path) -> None:
    export(run_dir, tmp_path / "hf")
    job = JobConfig(job_id="from-export", preset="tiny", steps=2, seed=1, init_from=str(tmp_path / "hf"))
    (tmp_path / "job.json").write_text(job.model_dump_json())
    metrics = tmp_path / "metrics.jsonl"
    cleave(
        "train",
        "--config",
        str(tmp_path / "job.json"),
        "--workers",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--metrics-out",
        str(metrics),
    )
    got = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    reference = Trainer(job)
    assert_same(got, [reference.step(s) for s in range(job.steps)])
    fresh = Trainer(job.model_copy(update={"init_from": None}))
    assert got[0] < fresh.step(0) - 0.1  # it starts from the trained weights, not from the seed's
    # its export over the folder it started from would replace its own base (a resume would start from the
    # fine-tuned weights; a LoRA adapter would be applied over them again): refused, the folder as it was
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    with pytest.raises(ConfigError, match="holds the job's own init_from"):
        jobs.export(tmp_path / "hf", run_dir=tmp_path / "run")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before


def test_an_export_replaces_only_an_earlier_export(tmp_path: Path) -> None:
    """Any folder with a config.json was taken for an earlier export and replaced whole: a model of the user's
    own, or an export the user had put notes in, lost its other files without a word."""
    mine, notes, earlier = tmp_path / "mine", tmp_path / "notes", tmp_path / "earlier"
    for folder, names in ((mine, ("config.json", "model.safetensors", "generation_config.json")),
                          (notes, ("config.json", "cleave_tokenizer.json", "NOTES.md")),
                          (earlier, ("config.json", "model.safetensors", "cleave_tokenizer.json", "tokenizer.json",
                                     "adapter"))):
        folder.mkdir()
        for name in names:
            (folder / name).write_text("{}")
    with pytest.raises(ConfigError, match="holds other files and is not an earlier export"):
        jobs.replaceable(mine)
    with pytest.raises(ConfigError, match="is an earlier export but also holds NOTES.md"):
        jobs.replaceable(notes)
    for fine in (earlier, tmp_path / "new", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        jobs.replaceable(fine)


def test_a_job_run_again_with_fewer_steps_says_it_trained_nothing(run_dir: Path, tmp_path: Path) -> None:
    """`--steps` below what the job already ran showed its old steps as progress ('step 2 (3/1)') and ended as if
    it had trained them."""
    shutil.copytree(run_dir, tmp_path / "run")
    said = cleave("train", "--preset", "tiny", "--steps", "1", "--workers", "1", "--run-dir", str(tmp_path / "run"),
                  "--job-id", JOB_ID).stdout
    assert f"job {JOB_ID} had already run {STEPS} steps, more than --steps 1: nothing was trained" in said, said
