"""`cleave export` of jobs beyond a plain run on a local stack: split learning (no whole model to export), a job
trained on a running stack's NATS exported by its own run dir, a `--reference` run (no checkpoint), and a LoRA
job's adapter written elsewhere (`--adapter-out`), against a real `cleave up` stack."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cleave import Job, run
from cleave.api import jobs
from cleave.errors import ConfigError
from cleave.models import build_model, get_preset
from cleave.models.hf import export_hf
from tests.integration.test_api import start_up

SPLIT, LORA, TUNED = "x-split", "x-lora", "x-tuned"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A `cleave up` stack with one worker, a split-learning job, a LoRA job and a job started from a model folder
    (`base`) trained on it (`run(nats=...)`, as `cleave train --nats`), each in a run dir of its own; the NATS URL
    and the folder of those run dirs."""
    root = tmp_path_factory.mktemp("hub")
    export_hf(build_model(get_preset("tiny"), seed=3), get_preset("tiny"), root / "base")  # a model to start from
    up, url = start_up(root / "up", "--workers", "1")
    try:
        for job in (Job(job_id=SPLIT, preset="tiny", method="split", steps=1, batch_size=2),
                    Job(job_id=LORA, preset="tiny", method="fedavg", lora_rank=4, local_steps=1, steps=1,
                        batch_size=2),
                    Job(job_id=TUNED, init_from=str(root / "base"), steps=1, batch_size=2)):
            assert [m["step"] for m in run(job, nats=url, run_dir=root / job.job_id)] == [0]
        yield url, root
    finally:
        up.terminate()
        up.wait(60)


def test_a_split_job_says_why_it_has_no_model_to_export(hub: tuple[str, Path], tmp_path: Path) -> None:
    """Its PS keeps only its half of the model: the export failed on the missing keys ('checkpoint of step 0 does
    not fit this model: keys [blocks.0...]')."""
    url, _ = hub
    with pytest.raises(ConfigError, match=f"job '{SPLIT}' is split learning .* the embeddings and block 0 are the "
                                          "client worker's, .* no whole model to export"):
        jobs.export(tmp_path / "hf", nats=url, job_id=SPLIT)
    assert not (tmp_path / "hf").exists()


def test_the_run_dir_of_a_job_trained_on_a_running_stack_names_where_its_state_is(hub: tuple[str, Path],
                                                                                   tmp_path: Path) -> None:
    """`cleave train --nats` keeps the job's state on that NATS, not in its run dir: the export said only that the
    run dir had no running NATS and no JetStream store."""
    url, root = hub
    with pytest.raises(ConfigError, match=re.escape(f"trained on the NATS at {url}, which keeps the job's state: "
                                                    f"export it from there (cleave export --nats {url} --job-id "
                                                    f"{LORA} --out OUT")):
        jobs.export(tmp_path / "hf", run_dir=root / LORA)
    assert jobs.export(tmp_path / "hf", nats=url, job_id=LORA).head.step == 0  # (where the message points)


def test_a_hubs_run_dir_lists_its_jobs_when_none_is_named(hub: tuple[str, Path], tmp_path: Path) -> None:
    """A hub's run dir (`cleave up --run-dir`) holds many jobs and no job.json: the export said only that it could
    not read the job id from job.json ([Errno 2] ...)."""
    _, root = hub
    with pytest.raises(ConfigError, match="has no job.json naming its job .a hub's run dir holds many.: name one "
                                          ".*jobs with a committed checkpoint there: ") as refused:
        jobs.export(tmp_path / "hf", run_dir=root / "up")
    assert sorted(str(refused.value).rpartition("there: ")[2].split(", ")) == [LORA, SPLIT, TUNED]
    assert jobs.export(tmp_path / "hf", run_dir=root / "up", job_id=LORA).head.step == 0


def test_a_job_whose_model_folder_is_not_here_names_it(hub: tuple[str, Path], tmp_path: Path) -> None:
    """The model's shape comes from init_from's config.json: exported where that folder is not (moved, or the
    hub's PS ran on another machine), the export said only 'invalid job: ... is not a directory nor a repo in the
    local Hugging Face cache'."""
    url, root = hub
    (root / "base").rename(root / "moved")
    try:  # (in a process of its own: this one has read the folder's config.json, and keeps it)
        said = subprocess.run([sys.executable, "-m", "cleave_cli", "export", "--nats", url, "--job-id", TUNED, "--out",
                               str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    finally:
        (root / "moved").rename(root / "base")
    assert said.returncode == 2, said.stderr
    assert (f"job '{TUNED}' started from init_from={root / 'base'}, whose config.json gives the model's shape, and "
            "it cannot be read here") in said.stderr, said.stderr
    assert jobs.export(tmp_path / "hf", nats=url, job_id=TUNED).head.step == 0


def test_a_reference_run_says_it_keeps_no_checkpoint(tmp_path: Path) -> None:
    """`cleave train --reference` trains in its own process and writes only metrics: the export said the run dir
    had no running NATS and no JetStream store, and not why."""
    ref = subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--steps", "1",
                          "--batch-size", "2", "--reference", "--run-dir", str(tmp_path / "ref")],
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    with pytest.raises(ConfigError, match="no stack ran there .a --reference run, .* keeps no checkpoint to export"):
        jobs.export(tmp_path / "hf", run_dir=tmp_path / "ref")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21, transformers 5
def test_an_adapter_folder_elsewhere_is_replaced_whole_and_only_an_earlier_one(hub: tuple[str, Path],
                                                                              tmp_path: Path) -> None:
    """`--adapter-out` wrote into any folder: the user's own files stayed beside the adapter, and an earlier
    adapter's files that the new one does not write (another job's base/ tokenizer) were read with it."""
    url, _ = hub
    out, mine = tmp_path / "hf", tmp_path / "mine"
    mine.mkdir()
    (mine / "NOTES.md").write_text("mine")
    with pytest.raises(ConfigError, match="holds other files and is not an earlier adapter export .* over an "
                                          "earlier adapter export "):  # (it said "an earlier an adapter export")
        jobs.export(out, nats=url, job_id=LORA, adapter_out=mine)
    assert [p.name for p in mine.iterdir()] == ["NOTES.md"] and not out.exists()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match="a-file is a file: the adapter is written as a folder"):
        jobs.export(out, nats=url, job_id=LORA, adapter_out=tmp_path / "a-file")
    with pytest.raises(ConfigError, match="holds the model's folder"):
        jobs.export(tmp_path / "both" / "hf", nats=url, job_id=LORA, adapter_out=tmp_path / "both")
    earlier = tmp_path / "adapter"
    (earlier / "base").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "base/config.json", "base/tokenizer.json"):
        (earlier / name).write_text("{}")  # an earlier adapter export of another job (a BPE tokenizer's base)
    got = jobs.export(out, nats=url, job_id=LORA, adapter_out=earlier)
    assert got.adapter == earlier
    assert sorted(p.name for p in earlier.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "base"]
    assert sorted(p.name for p in (earlier / "base").iterdir()) == ["cleave_tokenizer.json", "config.json",
                                                                     "model.safetensors", "tokenizer.json",
                                                                     "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "adapter", "hf", "mine"]  # (no staging left)
    for _ in range(2):  # an adapter folder of its own inside OUT: the same export again was refused ('also holds ad')
        jobs.export(tmp_path / "hf2", nats=url, job_id=LORA, adapter_out=tmp_path / "hf2" / "ad")
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == ["ad", "cleave_tokenizer.json", "config.json",
                                                                    "model.safetensors", "tokenizer.json",
                                                                    "tokenizer_config.json"]
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    tokens = torch.arange(32).reshape(2, 16) * 7 % 256  # (B, T) byte ids
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(out)(tokens).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(got.job.init_from or earlier / "base")
        adapted = peft.PeftModel.from_pretrained(base, earlier)(tokens).logits
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-4)
