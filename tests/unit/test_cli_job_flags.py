"""`cleave train` flags for the data-parallel methods become job fields; named DiLoCo settings expand."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cleave.methods import diloco, fedavg
from cleave.train.job import JobConfig
from cleave_cli.commands import job_from_args
from cleave_cli.main import build_parser, main


def job(*flags: str) -> JobConfig:
    return job_from_args(build_parser().parse_args(["train", "--preset", "tiny", *flags]))


def test_round_flags_are_job_fields() -> None:
    j = job("--method", "diloco", "--round-timeout", "7.5", "--max-staleness", "2", "--min-updates", "3",
            "--val-every", "4", "--local-steps", "6")
    assert (j.round_timeout_s, j.max_staleness, j.min_updates, j.val_every, j.local_steps) == (7.5, 2, 3, 4, 6)


def test_defaults_agree_and_named_settings_expand() -> None:
    j = job("--method", "diloco")
    assert j.local_steps == diloco.DEFAULT_INNER_STEPS == fedavg.DEFAULT_LOCAL_STEPS == diloco.DilocoConfig().inner_steps
    assert (j.local_steps, j.outer_lr, j.outer_momentum) == diloco.SETTINGS["default"]
    paper = job("--method", "diloco", "--diloco-setting", "paper")
    assert (paper.local_steps, paper.outer_lr, paper.outer_momentum) == (500, 0.7, 0.9)
    mixed = job("--method", "diloco", "--diloco-setting", "paper", "--local-steps", "20")  # a flag wins
    assert (mixed.local_steps, mixed.outer_lr, mixed.outer_momentum) == (20, 0.7, 0.9)


def test_a_settings_file_and_its_flags_combine_the_flags_winning(tmp_path: Path) -> None:
    """--preset with --config was refused by argparse although the file's help says flags win; --logits-bytes
    is a flag (it was settable only in a file)."""
    from cleave.models.gemms import DEFAULT_LOGITS_BYTES  # noqa: PLC0415

    f = tmp_path / "job.toml"
    f.write_text('job_id = "combined"\npreset = "tiny"\nsteps = 7\nlogits_bytes = 4096\n')
    j = job_from_args(build_parser().parse_args(["train", "--config", str(f), "--preset", "small",
                                                 "--logits-bytes", "65536"]))
    assert (j.job_id, j.preset, j.steps, j.logits_bytes) == ("combined", "small", 7, 65536)
    assert job("--logits-bytes", "1000").logits_bytes == 1000 and job().logits_bytes == DEFAULT_LOGITS_BYTES
    said = next(a.help for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                if a.dest == "logits_bytes")
    assert f"default {DEFAULT_LOGITS_BYTES >> 20} MiB" in said


def test_cleave_version_names_the_installed_distribution(capsys):
    from importlib import metadata  # noqa: PLC0415

    from cleave_cli.main import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"cleave {metadata.version('cleave-train')} (Python 3.")


def test_fine_tuning_flags_are_job_fields() -> None:
    j = job("--method", "fedavg", "--lora", "8", "--lora-alpha", "32", "--lora-targets", "c_attn, c_fc",
            "--sampling", "epochs", "--own-data", "--update-clip", "0.5", "--max-empty-rounds", "2", "--secagg",
            "--dp-noise", "0.8", "--dp-delta", "1e-6")
    assert (j.lora_rank, j.lora_alpha, j.lora_targets, j.sampling) == (8, 32.0, ("c_attn", "c_fc"), "epochs")
    assert (j.own_data, j.update_clip, j.max_empty_rounds, j.secagg, j.dp_noise, j.dp_delta) == (
        True, 0.5, 2, True, 0.8, 1e-6)
    plain = job("--method", "fedavg")
    assert (plain.own_data, plain.secagg, plain.lora_targets) == (False, False, ())


def test_bad_paths_counts_and_numbers_end_in_one_line_and_status_2(tmp_path, capsys) -> None:
    """What a user mistypes ends before any process starts, in one `cleave: error:` line (argparse's too, with
    where the options are listed instead of the whole usage), status 2: no traceback, no stack left running."""
    a_file, a_dir, binary = tmp_path / "a-file", tmp_path / "a-dir", tmp_path / "bin.toml"
    a_file.write_text("x")
    a_dir.mkdir()
    binary.write_bytes(b"\xff\xfe\x00steps = 2")
    (tmp_path / "spm").mkdir()  # a model folder whose tokenizer needs converting (it was trained on byte ids)
    (tmp_path / "spm" / "tokenizer.model").write_bytes(b"sentencepiece")
    cases = {
        ("train", "--preset", "tiny", "--tokenizer", str(tmp_path / "spm"), "--run-dir", str(tmp_path / "r")):
            "only a sentencepiece tokenizer.model; convert it",
        # (they said "a-file: File exists" and "a-dir: Is a directory", naming neither the option nor the fix)
        ("train", "--preset", "tiny", "--run-dir", str(a_file)):
            f"run dir {a_file} (--run-dir) cannot be used: {a_file} is a file, where a folder is needed",
        ("train", "--preset", "tiny", "--run-dir", str(a_file / "sub")): f"{a_file} is a file, where a folder",
        ("train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--metrics-out", str(a_dir)):
            f"metrics file {a_dir} (--metrics-out) cannot be written: it is a folder; name a file, e.g. "
            f"{a_dir / 'metrics.jsonl'}",
        ("train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--metrics-out", str(a_file / "m.jsonl")):
            f"metrics file {a_file / 'm.jsonl'} (--metrics-out) cannot be written: {a_file} is a file, where a",
        ("train", "--config", str(binary)): "not a text file",
        ("train", "--preset", "tiny", "--lr", "inf", "--dry-run"): "lr: Input should be a finite number",
        ("train", "--preset", "tiny", "--workers", "0", "--dry-run"): "--workers: must be at least 1, got 0",
        ("train", "--preset", "tiny", "--ps-replicas", "0", "--dry-run"): "--ps-replicas: must be at least 1, got 0",
        ("train", "--method", "fedavg", "--workers", "2", "--min-updates", "5", "--run-dir", str(tmp_path / "r")):
            "min_updates=5 (--min-updates) is more than the 2 workers of this stack",
        # (a robust rule that silently was the plain mean: only the PS's log said so)
        ("train", "--method", "fedavg", "--aggregate", "trimmed", "--workers", "4", "--run-dir", str(tmp_path / "r")):
            "with workers=4 (--workers) it is the plain mean; use --aggregate median",
        ("train", "--preset", "tiny", "--workers", "1", "--ps-replicas", "2", "--run-dir", str(tmp_path / "r")):
            "ps_replicas=2 (--ps-replicas) needs at least as many workers",
        # refused after rounds of retries (14 s, or minutes of round timeouts): a local stack cannot run them
        ("train", "--method", "fedavg", "--secagg", "--workers", "1", "--run-dir", str(tmp_path / "r")):
            "secagg (--secagg) needs at least 2 workers",
        ("train", "--method", "fedavg", "--own-data", "--workers", "2", "--run-dir", str(tmp_path / "r")):
            "a local stack's workers declare none",
        ("demo", "--workers", "1"): "--workers: must be at least 2, got 1",
        # told by the command that lacks it (it pointed to `cleave --help`), with the option meant
        ("train", "--presett", "tiny"): "cleave train: error: unrecognized arguments: --presett tiny; did you mean "
                                        "--preset? (`cleave train --help` lists the options)",
        ("train", "--preset", "tiny", "--auth", str(a_dir), "--dry-run"): "it needs nats (--nats URL)",
        ("up", "--max-running", "0"): "--max-running: must be at least 1, got 0",
        ("up", "--nats-cluster", "-1"): "--nats-cluster: must be at least 0, got -1",
        ("status", "--nats", "foo://127.0.0.1:1"): "expected nats://HOST:PORT or tls://HOST:PORT",
        ("train", "--preset", "tiny", "--nats", "http://127.0.0.1:1", "--dry-run"): "expected nats://HOST:PORT",
        ("up", "--run-dir", str(tmp_path / "up"), "--dashboard-listen", "127.0.0.1:99999"):
            "--dashboard-listen '127.0.0.1:99999': expected HOST or HOST:PORT",
        ("export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path)): "holds other files",
        ("plan", "--model", "tiny", "--fleet", "synthetic:99999999", "--batch-size", "8", "--seq-len", "64"):
            "N from 1 to 1,000,000",
        ("export", "--run-dir", str(tmp_path / "run"), "--out", str(a_file)): f"{a_file} is a file",
        ("export", "--nats", "nats://127.0.0.1:1", "--out", str(tmp_path / "x")):  # (it said nats= and job_id=)
            "needs the job's id (--job-id, job_id=)",
        ("export", "--run-dir", str(tmp_path / "run"), "--out", str(a_file / "sub")):  # (said 'File exists')
            f"{a_file} is a file: no folder can be made under it",
        ("runner", "--run-dir", str(a_file), "--nats", "nats://127.0.0.1:1"): f"{a_file}/logs: Not a directory",
        ("swarm", "--workers", "2", "--processes", "2", "--heartbeat-s", "-1"):  # (not each process, exit 1)
            "invalid setting heartbeat_s: Input should be greater than 0",
    }
    for argv, said in cases.items():
        try:
            status = main(list(argv))
        except SystemExit as e:  # argparse's refusal
            status = e.code
        err = capsys.readouterr().err
        assert status == 2 and said in err and "Traceback" not in err, (argv, status, err)
        assert "usage:" not in err and len(err.strip().splitlines()) == 1, (argv, err)  # one line, argparse's too
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())  # nothing started


def test_status_metrics_out_sets_another_jobs_file_aside(tmp_path: Path) -> None:
    """`cleave status --job-id J --metrics-out F` where F held another job's steps wrote nothing (its steps
    were taken for J's) and said nothing: F is set aside, as a PS does, and J's lines are written."""
    from cleave.schemas import StepMetrics  # noqa: PLC0415
    from cleave_cli.jobs_cmd import mirror  # noqa: PLC0415

    def steps(job: str, losses: list[float]) -> list[StepMetrics]:
        return [StepMetrics(job=job, step=i, loss=x, step_time_s=0.1, workers=1) for i, x in enumerate(losses)]

    f = tmp_path / "m.jsonl"
    assert mirror(f, "j2", steps("j2", [5.0, 4.0])) is None
    assert mirror(f, "j2", steps("j2", [5.0, 4.0, 3.0])) is None  # the same job, further on: appended
    assert [json.loads(x)["loss"] for x in f.read_text().splitlines()] == [5.0, 4.0, 3.0]
    kept = mirror(f, "j1", steps("j1", [6.0, 5.5]))
    assert kept is not None and kept.exists() and len(kept.read_text().splitlines()) == 3  # j2's, untouched
    assert [json.loads(x)["loss"] for x in f.read_text().splitlines()] == [6.0, 5.5]


def test_the_reference_of_an_approximate_method_says_what_it_trains(tmp_path, capsys) -> None:
    """`--reference` of diloco or fedavg trains plain AdamW steps (the exact baseline), not the method; it
    printed 'round' lines as though it ran the rounds."""
    assert main(["train", "--method", "fedavg", "--preset", "tiny", "--steps", "2", "--batch-size", "2",
                 "--local-steps", "3", "--reference", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "method fedavg is approximate: --reference trains the exact baseline" in out
    assert "over steps 0-1 (2 steps)" in out and "round" not in out.split("\n", 1)[1]


def test_the_summary_of_one_step_names_that_step(tmp_path, capsys) -> None:
    """One step's summary said 'over steps 3-3 (1 steps)'."""
    from cleave_cli.commands import summarize  # noqa: PLC0415

    summarize([{"step": 3, "loss": 2.5, "step_time_s": 0.2}], tmp_path / "m.jsonl")
    assert capsys.readouterr().out.startswith("loss 2.5000 at step 3; median step 0.200s")
    summarize([{"step": 0, "loss": 3.0, "step_time_s": 0.1}, {"step": 1, "loss": 2.0, "step_time_s": 0.3}],
              tmp_path / "m.jsonl", unit="round")
    assert "loss 3.0000 -> 2.0000 over rounds 0-1 (2 rounds); median round 0.200s" in capsys.readouterr().out
    # a job that found no state started over after its file's earlier lines were shown: each step once, its last
    old = [{"step": s, "loss": 9.0, "step_time_s": 5.0} for s in range(3)]
    new = [{"step": s, "loss": 4.0 - s, "step_time_s": 0.1} for s in range(5)]
    summarize(old + new, tmp_path / "m.jsonl")
    assert "loss 4.0000 -> 0.0000 over steps 0-4 (5 steps); median step 0.100s" in capsys.readouterr().out
    summarize([{"step": 0, "loss": 3.0, "step_time_s": 0.1, "dp_epsilon": 4.3772}], tmp_path / "m.jsonl", "round")
    assert "loss 3.0000 at round 0; median round 0.100s; epsilon 4.377; metrics in" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "says"), [
    (["--data", "{tmp}/gone.txt"], "data='{tmp}/gone.txt': cannot read {tmp}/gone.txt (No such file or directory)"),
    (["--data", "{tmp}/none/*.txt"], "data='{tmp}/none/*.txt': no files match"),
    (["--init-from", "{tmp}/no-model"], "init_from: {tmp}/no-model is not a directory nor a repo"),
])
def test_what_the_ps_cannot_read_is_told_before_a_stack_starts(tmp_path, capsys, flags, says) -> None:
    """A missing data file or model folder was told by the PS once the stack had started (12-14 s)."""
    run_dir = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--steps", "1", "--run-dir", str(run_dir),
            *(f.format(tmp=tmp_path) for f in flags)]
    assert main(argv) == 2
    assert says.format(tmp=tmp_path) in capsys.readouterr().err
    assert not run_dir.exists()  # no stack, no logs


def test_a_run_says_where_its_metrics_files_earlier_lines_went(tmp_path, capsys) -> None:
    """A PS that found no state of its job, or resumed from an older checkpoint, set the metrics file's lines aside
    and said so only in its own log: the user saw old steps shown, then steps from 0 again."""
    from cleave.runtime.metrics_file import MetricsFile  # noqa: PLC0415
    from cleave.schemas import StepMetrics  # noqa: PLC0415
    from cleave_cli.commands import tell_after  # noqa: PLC0415

    job, path = JobConfig(job_id="j", preset="tiny", steps=4), tmp_path / "m.jsonl"
    out = MetricsFile(path)
    out.write(StepMetrics(step=0, loss=5.0, step_time_s=0.1, workers=1))
    before = out.aside("j")
    kept = out.set_aside("j")  # what the PS does
    lines = [{"step": s, "loss": 1.0, "step_time_s": 0.1} for s in range(4)]
    tell_after(job, lines, "step", path, before, tmp_path / "ps.log")
    said = capsys.readouterr().out
    assert f"{path} held lines not of the model trained now" in said and f"they are kept in {kept}" in said, said
    assert f"{tmp_path / 'ps.log'} says which" in said
    tell_after(job, lines, "step", path, out.aside("j"), None)  # nothing new set aside, no step beyond: silent
    assert capsys.readouterr().out == ""


def test_every_job_made_without_an_id_gets_its_own(tmp_path) -> None:
    """Every `Job(...)` without an id was job 'job': a second one with other settings was refused ('job' already
    has state of another model), and a settings file naming `job_id = "job"` was given a new id (never resumed)."""
    assert JobConfig(preset="tiny").job_id != JobConfig(preset="tiny").job_id
    named, unnamed = tmp_path / "named.toml", tmp_path / "unnamed.toml"
    named.write_text('job_id = "job"\npreset = "tiny"\n')
    unnamed.write_text('preset = "tiny"\n')
    assert job_from_args(build_parser().parse_args(["train", "--config", str(named)])).job_id == "job"
    assert job_from_args(build_parser().parse_args(["train", "--config", str(unnamed)])).job_id.startswith("train-")


def test_a_dry_run_says_fits_only_of_a_job_the_ps_can_start(tmp_path, capsys) -> None:
    """`--dry-run` printed `fits` for jobs the PS then refused once a stack had started (~10 s later): a
    tokenizer larger than the model's vocabulary, an init_from of another architecture than its --preset, a
    token file that is not whole, a text too short to train on."""
    from cleave.models import build_model, get_preset  # noqa: PLC0415
    from cleave.models.hf import export_hf  # noqa: PLC0415
    from tests.unit.test_tokenizer import _gpt2_style  # noqa: PLC0415

    _gpt2_style().save(str(tmp_path / "tokenizer.json"))  # 400 tokens: over tiny's 256
    export_hf(build_model(get_preset("tiny")), get_preset("tiny"), tmp_path / "tiny-model")
    (tmp_path / "short.u16").write_bytes(b"abc")
    (tmp_path / "hello.txt").write_text("hello world\n")  # too little to train on
    shutil.copytree(tmp_path / "tiny-model", tmp_path / "cut")
    weights = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(tmp_path / "tiny-model", tmp_path / "bare")
    (tmp_path / "bare" / "model.safetensors").unlink()
    cases = {
        ("--preset", "tiny", "--init-from", str(tmp_path / "cut")): "cannot read its weights, the file is truncated",
        ("--preset", "tiny", "--init-from", str(tmp_path / "bare")): "no weights in",
        ("--preset", "tiny", "--tokenizer", str(tmp_path / "tokenizer.json")):
            "has 400 tokens but preset 'tiny' has vocab_size=256",
        ("--preset", "tiny-llama", "--init-from", str(tmp_path / "tiny-model")): "does not fit preset='tiny-llama'",
        ("--preset", "tiny", "--data", str(tmp_path / "short.u16")): "3 bytes is not a whole number of uint16 tokens",
        ("--preset", "tiny", "--data", str(tmp_path / "hello.txt")): "has 12 tokens; need at least 4096",
    }
    for flags, said in cases.items():
        assert main(["train", *flags, "--dry-run"]) == 2, flags
        out = capsys.readouterr()
        assert said in out.err and "fits" not in out.out, (flags, out)


def test_the_demo_refuses_a_used_run_dir_and_no_steps(tmp_path, capsys) -> None:
    """Run again into its run dir, the demo replayed the earlier run's steps as new, skipped its kill (the earlier
    run's trigger was left there) and still reported it; --steps 0 ran 30 steps."""
    from cleave_cli.main import main  # noqa: PLC0415

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
    assert main(["demo", "--run-dir", str(tmp_path)]) == 2
    assert "already holds a run: the demo starts afresh" in capsys.readouterr().err
    assert main(["demo", "--run-dir", str(tmp_path / "new"), "--steps", "0"]) == 2
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # refused before anything started


def test_a_dry_run_reads_a_token_files_sidecar(tmp_path, capsys) -> None:
    """A token file made with another tokenizer passed `--dry-run` as `fits`; the PS refused it 8 s into the run."""
    import json  # noqa: PLC0415

    from cleave.models.tokenizer import ByteTokenizer  # noqa: PLC0415
    from cleave.train.sources import prepare_data  # noqa: PLC0415

    prepare_data("builtin", ByteTokenizer(), tmp_path / "t.u16")
    sidecar = tmp_path / "t.u16.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "tokenizer": str(tmp_path / "other-tok")}))
    assert main(["train", "--preset", "tiny", "--data", str(tmp_path / "t.u16"), "--dry-run",
                 "--run-dir", str(tmp_path / "run")]) == 2
    assert f"was tokenised with '{tmp_path / 'other-tok'}'; set tokenizer=" in capsys.readouterr().err


CTRL_C_AT_IMPORT = """import os, signal, sys
def hook(event, args):
    if event == "import" and args[0] == "cleave_cli.hub":
        os.kill(os.getpid(), signal.SIGINT)
sys.addaudithook(hook)
"""


def test_a_ctrl_c_while_the_command_line_is_read_exits_130_without_a_traceback(tmp_path) -> None:
    """The first seconds of every command go to building its parser, which imports every command (torch too):
    a Ctrl-C there ended in a KeyboardInterrupt traceback. Here a real SIGINT arrives as the parser imports one
    of the commands (a sitecustomize's audit hook sends it)."""
    (tmp_path / "sitecustomize.py").write_text(CTRL_C_AT_IMPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    # (SIGINT's default action restored: a shell that runs its commands in the background without job control,
    # as a CI script may, leaves them ignoring it, and Python then raises no KeyboardInterrupt at all)
    got = subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=120,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert got.returncode == 130 and "Traceback" not in got.stderr and not got.stdout, got


def test_every_option_of_train_and_submit_says_what_it_does() -> None:
    """`cleave train --help` listed --steps, --seed, --batch-size, --lr and --metrics-out with no word and no
    default: a new user learnt from it neither what a step count or learning rate the job would take."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("train", "submit"):
        silent = [a.option_strings[0] for a in sub.choices[command]._actions if not a.help]
        assert not silent, (command, silent)
    said = sub.choices["train"].format_help()
    assert "training steps (default 20" in said and "(default 8)" in said and "(default 2e-3)" in said, said
    job = JobConfig(preset="tiny")  # (--local-steps, --outer-lr and --outer-momentum said no default)
    for flag, value in (("--local-steps", job.local_steps), ("--outer-lr", job.outer_lr),
                        ("--outer-momentum", job.outer_momentum)):
        option = next(a for a in sub.choices["train"]._actions if flag in a.option_strings)
        assert f"(default {value:g}" in option.help, (flag, option.help)


def test_output_into_a_closed_pipe_ends_quietly_with_sigpipes_status() -> None:
    """`cleave train --dry-run | head -1` ended in a BrokenPipeError traceback (the reader had gone); it ends
    quietly, 128 + SIGPIPE, as a program SIGPIPE ends does."""
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line
    try:
        got = subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--dry-run"],
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert got.returncode == 128 + signal.SIGPIPE and got.stderr == "", got


@pytest.mark.parametrize(("flags", "says"), [
    (["--micro-batches", "3", "--batch-size", "4"], "--micro-batches 3 must divide --batch-size 4"),
    (["--batch-size", "0"], "invalid option --batch-size:"),
    (["--method", "diloco", "--round-timeout", "-1"], "invalid option --round-timeout:"),
    (["--preset", "Tiny"], "--preset 'Tiny' is unknown (did you mean 'tiny'?)"),
    (["--method", "fedavg", "--dp-noise", "1"], "--dp-noise > 0 needs --update-clip > 0"),  # (also one not given)
])
def test_a_bad_option_is_named_as_the_option(flags, says) -> None:
    """The command line's errors named the job's Python settings (`micro_batches=3`), which no option is called."""
    from cleave.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=re.escape(says)):
        job_from_args(build_parser().parse_args(["train", *flags]))


def test_a_settings_files_error_keeps_the_files_names(tmp_path) -> None:
    f = tmp_path / "job.toml"
    f.write_text("micro_batches = 3\nbatch_size = 4\n")
    from cleave.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=re.escape("micro_batches=3 must divide batch_size=4")):
        job_from_args(build_parser().parse_args(["train", "--config", str(f)]))


def test_commands_started_in_the_same_second_get_run_dirs_of_their_own(tmp_path, monkeypatch) -> None:
    """`cleave up` and `cleave demo` name their run dir to the second: a second one started in that second
    was refused, the first's run dir being in use."""
    from cleave.api import fleet  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fleet.time, "strftime", lambda _fmt: "20261207-080000")
    made = [fleet.default_run_dir("demo") for _ in range(3)]
    assert [str(d) for d in made] == ["runs/demo-20261207-080000", "runs/demo-20261207-080000-2",
                                      "runs/demo-20261207-080000-3"]
    assert all(d.is_dir() for d in made)


def test_a_diverging_job_ends_saying_so_not_in_a_traceback(tmp_path, capsys) -> None:
    """`cleave train --reference` at a learning rate far too high ended in FloatingPointError's traceback, and
    the PS of the same job failed five times in a row into the same divergence: both end with status 4 and why."""
    from cleave.errors import StepAborted  # noqa: PLC0415
    from cleave.train.trainer import Trainer  # noqa: PLC0415

    assert main(["train", "--preset", "tiny", "--steps", "8", "--lr", "1e8", "--reference", "--run-dir",
                 str(tmp_path / "r")]) == 4
    err = capsys.readouterr().err
    assert "the training diverged: loss is nan at step" in err and "(--lr)" in err and "Traceback" not in err, err
    trainer = Trainer(JobConfig(preset="tiny", steps=8, lr=1e8))  # the PS's trainer: StepAborted ends its job
    with pytest.raises(StepAborted, match="the training diverged"):  # (status 4, not restarted)
        for step in range(8):
            trainer.step(step)
