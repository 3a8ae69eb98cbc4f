"""Job settings that the chosen method would ignore are refused at parse time, naming the setting and the
method it needs: in JobConfig, in job files and on the command line."""

from __future__ import annotations

import json

import pytest

from cleave.errors import ConfigError
from cleave.train.job import METHOD_SETTINGS, JobConfig
from cleave_cli.main import main as cli

METHODS = ("cleave", "diloco", "fedavg", "split")
# a value other than the default for every method-specific setting
NON_DEFAULT = {"split_layers": 2, "local_steps": 3, "outer_lr": 0.5, "outer_momentum": 0.5, "aggregate": "median",
               "compress": "int8", "lora_rank": 4, "lora_alpha": 8.0, "round_timeout_s": 30.0, "max_staleness": 2,
               "min_updates": 1, "init_from": "some/dir", "precision": "bf16", "lora_targets": ("c_attn",),
               "own_data": True, "update_clip": 1.0, "max_empty_rounds": 5, "secagg": True, "dp_noise": 1.0,
               "dp_delta": 1e-6, "recompute": True, "micro_batches": 2, "logits_bytes": 1024}
# what a setting needs besides its method to apply at all
NEEDS = {"lora_alpha": {"lora_rank": 4}, "lora_targets": {"lora_rank": 4}, "dp_noise": {"update_clip": 1.0},
         "dp_delta": {"dp_noise": 1.0, "update_clip": 1.0}}


def test_every_method_specific_setting_has_a_value_to_try():
    assert set(NON_DEFAULT) == set(METHOD_SETTINGS)


@pytest.mark.parametrize("name", sorted(METHOD_SETTINGS))
def test_a_setting_is_refused_under_a_method_that_ignores_it(name):
    for method in METHODS:
        fields = {"method": method, "preset": "tiny", name: NON_DEFAULT[name]}  # (no init_from dir is read)
        if method in METHOD_SETTINGS[name]:
            JobConfig.build(**fields, **NEEDS.get(name, {}))
            continue
        with pytest.raises(ConfigError) as e:
            JobConfig.build(**fields)
        wanted = " or ".join(METHOD_SETTINGS[name])
        assert f"{name}=" in str(e.value) and f"method={method!r}" in str(e.value), e.value
        assert f"needs method {wanted}" in str(e.value), e.value


def test_defaults_pass_under_every_method_and_explicit_defaults_too():
    for method in METHODS:
        JobConfig.build(method=method)
        JobConfig.build(method=method, split_layers=1, compress="none", lora_rank=0)


def test_lora_alpha_needs_a_rank_and_compress_a_valid_spec():
    with pytest.raises(ConfigError, match=r"lora_alpha=8.0 has no effect unless lora_rank > 0"):
        JobConfig.build(method="fedavg", lora_alpha=8.0)
    with pytest.raises(ConfigError, match=r"compression='int9' is not one of"):
        JobConfig.build(method="diloco", compress="int9")


def test_split_layers_and_lora_targets_name_what_the_model_has():
    """Refused by the job itself, so `--reference` refuses them too: it trained them, while the fleet's PS
    refused them only once the stack had started."""
    with pytest.raises(ConfigError, match="split_layers=3 must be between 0 and the model's n_layer=2"):
        JobConfig.build(method="split", preset="tiny", split_layers=3)
    assert JobConfig.build(method="split", preset="tiny", split_layers=2).split_layers == 2
    with pytest.raises(ConfigError, match="lora_targets 'nosuch' name no linear layer of the model; it has c_attn, "
                                          r"c_fc, c_proj$"):
        JobConfig.build(method="fedavg", preset="tiny", lora_rank=4, lora_targets=("c_attn", "nosuch"))
    # the head was offered, accepted, and failed every round on every worker (its loss reads its weight)
    with pytest.raises(ConfigError, match="lora_targets cannot name lm_head"):
        JobConfig.build(method="fedavg", preset="tiny", lora_rank=4, lora_targets=("c_attn", "lm_head"))
    llama = JobConfig.build(method="fedavg", preset="tiny-llama", lora_rank=4, lora_targets=("q_proj", "v_proj"))
    assert llama.lora_targets == ("q_proj", "v_proj")


def test_secure_aggregation_and_dp_refuse_what_they_cannot_do():
    with pytest.raises(ConfigError, match=r"secagg needs aggregate='mean'.*aggregate='median'"):
        JobConfig.build(method="fedavg", secagg=True, aggregate="median")
    with pytest.raises(ConfigError, match=r"dp_noise > 0 needs update_clip > 0"):
        JobConfig.build(method="fedavg", dp_noise=1.0)
    with pytest.raises(ConfigError, match=r"dp_delta=1e-06 has no effect unless dp_noise > 0"):
        JobConfig.build(method="fedavg", dp_delta=1e-6)


def test_the_issue_example_is_refused():
    with pytest.raises(ConfigError, match=r"lora_rank=8 does not apply to method='cleave': it needs method diloco"):
        JobConfig.build(method="cleave", lora_rank=8, compress="int8")


def test_job_files_and_the_cli_refuse_them(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"preset": "tiny", "method": "split", "compress": "fp16"}))
    with pytest.raises(ConfigError, match=r"compress='fp16' does not apply to method='split'"):
        JobConfig.load(path)
    assert cli(["train", "--config", str(path), "--reference", "--run-dir", str(tmp_path / "r")]) == 2
    assert "compress='fp16' does not apply to method='split'" in capsys.readouterr().err
    assert cli(["train", "--preset", "tiny", "--lora", "8", "--reference", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--lora-rank 8 does not apply to --method 'cleave': it needs method diloco or fedavg" in capsys.readouterr().err


def test_the_metrics_tail_reads_whole_lines_and_a_file_begun_anew_from_its_start(tmp_path):
    from cleave.api.fleet import MetricsTail

    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []
    path.write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert tail.read() == [{"step": 0}, {"step": 1}]  # the torn last line waits for its end
    with open(path, "a") as f:
        f.write('ep": 2}\n')
    assert tail.read() == [{"step": 2}]
    path.rename(tmp_path / "m.before.jsonl")  # set aside, and a new file begun with longer lines
    path.write_text('{"step": 0, "loss": 5.25, "pad": "................"}\n')
    assert tail.read() == [{"step": 0, "loss": 5.25, "pad": "................"}]


def test_a_tail_of_new_lines_skips_the_earlier_runs_also_when_they_are_copied_into_a_file_begun_anew(tmp_path):
    """A resumed `cleave train` showed every earlier step again as if new (`jobs.run` yielded the whole file)."""
    from cleave.api.fleet import MetricsTail
    from cleave.runtime.metrics_file import MetricsFile

    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {5 - s / 10}}}\n' for s in range(4)))
    tail = MetricsTail(path, new_only=True)
    assert tail.read() == [] and tail.last == 3
    with open(path, "a") as f:
        f.write('{"step": 4, "loss": 4.5}\n')
    assert tail.read() == [{"step": 4, "loss": 4.5}] and tail.last == 4
    MetricsFile(path).cut_after(1, "j")  # a resume from the checkpoint of step 1: steps 2-4 are trained again
    with open(path, "a") as f:
        f.write('{"step": 2, "loss": 4.75}\n')
    assert tail.read() == [{"step": 2, "loss": 4.75}] and tail.last == 2
    assert MetricsTail(tmp_path / "none.jsonl", new_only=True).read() == []
