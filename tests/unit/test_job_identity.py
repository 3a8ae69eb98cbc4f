"""What a job is, for resuming it: its model and its data order. Any other setting may change between runs."""

from __future__ import annotations

import json
from pathlib import Path

from cleave.runtime.metrics_file import MetricsFile
from cleave.schemas import StepMetrics
from cleave.train.identity import IDENTITY, identity_changes, other_changes, refusal
from cleave.train.job import JobConfig, located


def job(**kw) -> str:
    return JobConfig.build(**{"job_id": "j", "preset": "tiny", **kw}).model_dump_json()


def test_steps_the_learning_rate_and_timeouts_may_change() -> None:
    before = job(steps=10)
    after = job(steps=40, lr=1e-3, warmup_steps=2, val_every=5, grad_clip=0.5)
    assert identity_changes(before, after) == []
    assert set(other_changes(before, after)) == {"steps", "lr", "warmup_steps", "val_every", "grad_clip"}


def test_the_model_and_the_data_order_may_not() -> None:
    base = job()
    for change, field in (({"seed": 1}, "seed"), ({"batch_size": 4}, "batch_size"), ({"preset": "tiny-llama"}, "preset"),
                          ({"seq_len": 32}, "seq_len"), ({"val_fraction": 0.2}, "val_fraction")):
        changed = identity_changes(base, job(**change))
        assert [c.split(":")[0] for c in changed] == [field], changed
    assert identity_changes(base, job(seed=2)) == ["seed: 0 -> 2"]
    assert set(IDENTITY) <= set(JobConfig.model_fields)


def test_a_dp_jobs_noise_and_the_lora_layers_may_not() -> None:
    """The epsilon a DP job reports counts every round at the job's noise: a resume with another --dp-noise
    reported 20.1 falling to 1.55, and one without it turned DP off unsaid. A resume with other LoRA layers was
    allowed and then failed on a checkpoint that did not fit the model."""
    dp = dict(method="fedavg", update_clip=1.0)
    base = job(**dp, dp_noise=0.5)
    assert identity_changes(base, job(**dp, dp_noise=5.0)) == ["dp_noise: 0.5 -> 5.0"]
    assert identity_changes(base, job(method="fedavg")) == ["dp_noise: 0.5 -> 0.0"]
    assert identity_changes(base, job(method="fedavg", dp_noise=0.5, dp_delta=1e-6, update_clip=2.0)) == []
    lora = dict(method="fedavg", lora_rank=4)
    assert identity_changes(job(**lora, lora_targets=["c_attn"]), job(**lora, lora_targets=["c_fc"])) == [
        "lora_targets: ['c_attn'] -> ['c_fc']"]
    refused = refusal("j", base, 3, job(**dp, dp_noise=5.0))
    assert refused is not None and "up to round 3) of another model, data order or privacy noise" in str(refused)
    assert refusal("j", base, 3, job(**dp, dp_noise=0.5, steps=40)) is None


def test_a_description_written_before_a_setting_existed_reads_it_at_its_default() -> None:
    assert identity_changes('{"job_id": "j", "preset": "tiny"}', job()) == []


def test_seq_len_left_open_is_the_models_block_size() -> None:
    """Naming the block size (64 for tiny) resumes a job that left seq_len open (it was refused as 'None ->
    64'), and a real change says what it was."""
    assert identity_changes(job(), job(seq_len=64)) == []
    assert identity_changes(job(), job(seq_len=48)) == ["seq_len: 64 -> 48"]


def test_the_data_named_from_another_folder_is_the_same_job_and_another_file_is_not(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """The PS recorded a job's paths as typed: resumed from another working directory, the same corpus named
    another way was refused as other data, and another corpus of the same name was taken for the job's own."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "corpus.txt").write_text(f"corpus {d}\n")
    monkeypatch.chdir(tmp_path / "a")
    first = JobConfig(job_id="j", data="corpus.txt", tokenizer="../b")
    stored = located(first)  # (recorded by the PS run from a/)
    recorded = json.loads(stored)
    assert (recorded["data"], recorded["tokenizer"]) == (str(tmp_path / "a" / "corpus.txt"), str(tmp_path / "b"))
    assert first.data == "corpus.txt"  # the job itself as given: each worker reads it from its own folder
    for spec, want in (("*.txt", str(tmp_path / "a" / "*.txt")), ("hf:../b?split=train", f"hf:{tmp_path / 'b'}?split=train"),
                       ("builtin", "builtin"), ("gone.txt", "gone.txt")):
        assert json.loads(located(JobConfig(data=spec)))["data"] == want
    monkeypatch.chdir(tmp_path)
    assert identity_changes(stored, job(data="a/corpus.txt", tokenizer="b")) == []
    monkeypatch.chdir(tmp_path / "b")
    assert identity_changes(stored, job(data="corpus.txt", tokenizer=".")) == [
        f"data: {str(tmp_path / 'a' / 'corpus.txt')!r} -> {str(tmp_path / 'b' / 'corpus.txt')!r}"]
    # a job recorded before its paths were made absolute is read from where the PS runs
    monkeypatch.chdir(tmp_path / "a")
    assert identity_changes(first.model_dump_json(), stored) == []


def test_a_new_job_sets_another_jobs_metrics_aside_and_never_deletes_them(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    out = MetricsFile(path)
    assert out.set_aside("new") is None  # nothing there
    out.write(StepMetrics(step=0, loss=1.0, step_time_s=0.1, workers=1))
    kept = out.set_aside("new")
    assert kept is not None and kept.name.startswith("metrics.before-new-") and kept.suffix == ".jsonl"
    assert not path.exists() and '"step": 0' in kept.read_text()
