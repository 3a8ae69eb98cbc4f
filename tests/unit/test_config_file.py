"""One settings file: a job's keys at its top level and the services' tables ([ps], [worker], ...), flags over
environment variables over the file over the defaults, and errors that name the file and the key. A worker
process started with `--config` takes its table of the file, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cleave import bus as busmod
from cleave.errors import ConfigError
from cleave.runtime.config_file import CONFIG_ENV
from cleave.schemas import SUBJECT_HEARTBEAT_ALL
from cleave.train.job import JobConfig
from cleave_cli.main import main as cli
from cleave_monitor.settings import MonitorSettings
from cleave_ps.settings import PsSettings
from cleave_scheduler.settings import SchedulerSettings
from cleave_worker.settings import WorkerSettings

EVERY_KNOB = """\
# a job with every kind of value a job file holds
preset = "tiny"
method = "fedavg"
steps = 3
batch_size = 4
seq_len = 32
lr = 1e-3
precision = "bf16"
local_steps = 2
lora_rank = 4
lora_targets = ["c_attn", "c_fc"]
update_clip = 1.0
own_data = false
data = "builtin"

[ps]
persist_every = 7
tile_timeout_s = 2.5

[worker]
threads = 2
worker_id = "from-the-file"
profile = "flops=1e10,down=1e8,up=1e8,latency=0.001,memory=1e9"  # declared: it joins without a scheduler's probe

[scheduler]
liveness_s = 3.0
"""


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cleave.toml"
    path.write_text(EVERY_KNOB)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    for name in ("CLEAVE_WORKER_THREADS", "CLEAVE_WORKER_ID", "CLEAVE_WORKER_WORKER_ID", "CLEAVE_PS_PERSIST_EVERY"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_the_job_is_the_files_top_level_and_flags_win(settings: Path) -> None:
    job = JobConfig.load(settings)
    assert (job.method, job.steps, job.batch_size, job.seq, job.precision) == ("fedavg", 3, 4, 32, "bf16")
    assert job.lora_targets == ("c_attn", "c_fc")
    assert JobConfig.load(settings, steps=9, batch_size=2).steps == 9
    assert JobConfig.load(settings, steps=9, batch_size=2).batch_size == 2


def test_services_read_their_table_under_the_environment_and_flags(settings: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().threads == 1  # no file named: the default
    monkeypatch.setenv(CONFIG_ENV, str(settings))
    assert WorkerSettings().threads == 2 and WorkerSettings().worker_id == "from-the-file"
    assert (PsSettings().persist_every, PsSettings().tile_timeout_s) == (7, 2.5)
    monkeypatch.setenv("CLEAVE_WORKER_THREADS", "3")  # the environment over the file
    monkeypatch.setenv("CLEAVE_WORKER_ID", "from-the-environment")
    assert WorkerSettings().threads == 3 and WorkerSettings().worker_id == "from-the-environment"
    assert WorkerSettings(threads=4, worker_id="from-a-flag").threads == 4  # a flag over both
    assert WorkerSettings(threads=4, worker_id="from-a-flag").worker_id == "from-a-flag"


@pytest.mark.parametrize(("body", "says"), [
    ('preset = "tiny"\nbatch_sise = 4\n', "unknown job setting batch_sise (did you mean batch_size?)"),
    ('batch_size = "four"\n', "invalid job setting batch_size: Input should be a valid integer"),
    ("steps = \n", "not valid TOML"),
    ('method = "split"\ncompress = "fp16"\n', "compress='fp16' does not apply to method='split'"),
    ("steps = true\n", "invalid job setting steps: Input should be a valid integer"),  # not 1
    ('lr = "0.1"\n', "invalid job setting lr: Input should be a valid number"),
    ("own_data = 1\nmethod = \"fedavg\"\n", "invalid job setting own_data: Input should be a valid boolean"),
    ("batch_size = 8.0\n", "invalid job setting batch_size: Input should be a valid integer"),
])
def test_a_bad_job_file_names_the_file_and_the_key(tmp_path: Path, body: str, says: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as e:
        JobConfig.load(path)
    assert str(e.value).startswith(f"{path}") and says in str(e.value), e.value


def test_a_bad_service_table_names_the_file_and_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cleave.toml"
    monkeypatch.setenv(CONFIG_ENV, str(path))
    path.write_text("[worker]\nthreds = 2\n")
    with pytest.raises(ConfigError, match=r"unknown setting in \[worker\]: threds; known: .*threads"):
        WorkerSettings()
    path.write_text("[ps]\npersist_every = -1\n")
    with pytest.raises(ConfigError, match=rf"\[ps\] of {path}\): invalid setting persist_every: .*greater than"):
        PsSettings()
    JobConfig.load(path)  # the job's part is fine: only the PS's table is wrong


@pytest.mark.parametrize(("line", "says"), [
    ("[worker]\nheartbeat_s = true", "[worker] heartbeat_s = true: Input should be a valid number"),
    ("[worker]\nthreads = 2.0", "[worker] threads = 2.0: Input should be a valid integer"),
    ("[worker]\nworker_id = 5", "[worker] worker_id = 5: Input should be a valid string"),
    ("[ps]\npersist_every = \"10\"", "[ps] persist_every = \"10\": Input should be a valid integer"),
    ("[scheduler]\nliveness_s = 1979-05-27", "[scheduler] liveness_s = 1979-05-27: not a number, string or boolean"),
])
def test_a_service_table_value_of_the_wrong_type_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          line: str, says: str) -> None:
    """A TOML value is typed: `true` is not 1.0 and 2.0 is not 2 (each was taken as that). The same text in an
    environment variable, always a string, is converted (`CLEAVE_WORKER_THREADS=2`)."""
    path = tmp_path / "cleave.toml"
    monkeypatch.setenv(CONFIG_ENV, str(path))
    path.write_text(line + "\n")
    settings = {"worker": WorkerSettings, "ps": PsSettings, "scheduler": SchedulerSettings}[line[1:line.index("]")]]
    with pytest.raises(ConfigError) as refused:
        settings()
    assert str(refused.value) == f"{path}: {says}"


@pytest.mark.parametrize("settings", [PsSettings, WorkerSettings, SchedulerSettings, MonitorSettings])
def test_every_service_default_written_in_its_table_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                settings: type) -> None:
    """What the strict table check lets through: each setting's default, as a file would hold it."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    expected = settings().model_dump(mode="json")
    defaults = {k: "" if "*" in str(v) else v for k, v in expected.items() if v is not None}  # (secrets: ****)
    path = tmp_path / "cleave.json"
    path.write_text(json.dumps({settings.config_table: defaults}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert settings().model_dump(mode="json") == expected


def test_an_unknown_variable_or_fault_point_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """A misspelt CLEAVE_PS_* variable, or a fault point no code calls, would silently do nothing: refused."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv("CLEAVE_PS_PERSIST_EVRY", "3")
    with pytest.raises(ConfigError, match=r"unknown variable CLEAVE_PS_PERSIST_EVRY \(did you mean "
                                          r"CLEAVE_PS_PERSIST_EVERY\?\)"):
        PsSettings()
    assert cli(["ps"]) == 2  # before any connection: one line, status 2
    assert "unknown variable CLEAVE_PS_PERSIST_EVRY" in capsys.readouterr().err
    monkeypatch.delenv("CLEAVE_PS_PERSIST_EVRY")
    monkeypatch.setenv("CLEAVE_PS_FAIL_AT", "after_comit:3")
    with pytest.raises(ConfigError, match="fail_at point 'after_comit' is unknown here; known: before_commit"):
        PsSettings()
    monkeypatch.setenv("CLEAVE_PS_FAIL_AT", "garbage")
    with pytest.raises(ConfigError, match="fail_at entry 'garbage' must look like POINT:STEP"):
        PsSettings()
    monkeypatch.setenv("CLEAVE_PS_FAIL_AT", "before_commit:3,in_step:2")
    assert PsSettings().fail_at == "before_commit:3,in_step:2"
    monkeypatch.setenv("CLEAVE_WORKER_FAIL_AT", "in_step:2")  # a PS point is no worker's
    with pytest.raises(ConfigError, match="fail_at point 'in_step' is unknown here; known: tile"):
        WorkerSettings()
    monkeypatch.setenv("CLEAVE_WORKER_FAIL_AT", "tile:2")
    monkeypatch.setenv("CLEAVE_WORKER_ID", "an-alias")  # the worker id's aliases are known names
    assert WorkerSettings().worker_id == "an-alias"


@pytest.mark.parametrize(("env", "says"), [
    ({"CLEAVE_PS_REPLICA": "5"}, "replica=5 and fail_replica=-1 must be below replicas=1"),
    ({"CLEAVE_PS_METRICS_OUT": "/proc/no/m.jsonl"}, "/proc/no: No such file or directory"),
    ({"CLEAVE_MONITOR_HOST": "8.8.8.8"}, "the monitor cannot listen on 8.8.8.8:"),
    ({"CLEAVE_MONITOR_NATS_NKEY_SEED": "notaseed"}, "CLEAVE_MONITOR_NATS_NKEY_SEED is not a NATS user seed"),
    ({"CLEAVE_SCHEDULER_NATS_URL": "nats://127.0.0.1:0"}, "invalid setting nats_url"),
    ({"CLEAVE_WORKER_HEARTBEAT_S": "inf"}, "invalid setting heartbeat_s: Input should be a finite number"),
    ({"CLEAVE_WORKER_LIE_WEIGHT": "nan"}, "invalid setting lie_weight: Input should be a finite number"),
    ({"CLEAVE_WORKER_THREADS": "1000000"}, "invalid setting threads: Input should be less than or equal to 1024"),
    ({"CLEAVE_WORKER_MODEL_CACHE": "/etc/passwd"}, "model_cache: /etc/passwd is not a folder"),
    ({"CLEAVE_WORKER_NATS_NKEY_SEED": "SUjunk"}, "CLEAVE_WORKER_NATS_NKEY_SEED: not a NATS user seed"),
    ({"CLEAVE_WORKER_NATS_PASSWORD": "secret"}, "CLEAVE_WORKER_NATS_PASSWORD is set without CLEAVE_WORKER_NATS_USER"),
    ({"CLEAVE_MONITOR_TOKEN": "a"}, "a token shorter than 16 characters could be guessed"),
    ({"CLEAVE_MONITOR_URL_FILE": "/tmp"}, "/tmp is a folder; the dashboard's URL is written to a file"),
    ({"CLEAVE_WORKER_MEMORY_BYTES": str(10**30)}, "invalid setting memory_bytes: Input should be less than or equal to"),
    ({"CLEAVE_SCHEDULER_PROBE_NKEY_SEED": "SUjunk"}, "CLEAVE_SCHEDULER_PROBE_NKEY_SEED: not a NATS user seed"),
    ({"CLEAVE_SCHEDULER_PROBE_NKEY_SEED": "x"}, "CLEAVE_SCHEDULER_PROBE_NKEY_SEED is not a NATS user seed"),
])
def test_a_service_refuses_a_setting_it_could_only_crash_on_or_retry_for_ever(
        env: dict[str, str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Each of these was accepted: a segfault in libgomp (a million threads), retries for ever (a malformed
    seed), a login that ignored the password, an infinite heartbeat period, a PS replica that is none of the
    group, a metrics file the PS could not write after its first step, a monitor that could not bind (a
    traceback), a port 0 to dial. Status 2 and one line, at once."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    service = next(iter(env)).split("_")[1].lower()
    assert cli([service, *(["--nats", "nats://127.0.0.1:1"] if service != "scheduler" else [])]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_cleave_train_reads_the_ps_table_of_its_config(settings: Path, capsys: pytest.CaptureFixture) -> None:
    """`cleave train --config` hands the file to the stack's services: the PS's memory from [ps] refuses the job."""
    settings.write_text('preset = "tiny"\nbatch_size = 2\n[ps]\nmemory_bytes = 1000000\n')
    assert cli(["train", "--config", str(settings), "--dry-run", "--workers", "2"]) == 2
    assert "but 0.00 GB are available" in capsys.readouterr().err


def test_a_worker_process_takes_its_table(settings: Path, nats_url: str) -> None:
    """A real worker started with --config announces the id its table gives, to a real nats-server."""

    async def first_heartbeat() -> str:
        bus = await busmod.connect(nats_url, "test")
        got: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on(msg) -> None:  # noqa: ANN001 - a nats-py Msg
            if not got.done():
                got.set_result(msg.subject.rsplit(".", 1)[-1])

        await bus.nc.subscribe(SUBJECT_HEARTBEAT_ALL, cb=on)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "cleave_cli", "worker", "--nats", nats_url,
                                                    "--config", str(settings), stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL)
        try:
            return await asyncio.wait_for(got, 60)
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
            await bus.close()

    assert asyncio.run(first_heartbeat()) == "from-the-file"


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple | list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


@pytest.mark.parametrize("method", ["cleave", "fedavg", "diloco", "split"])
def test_every_job_setting_reads_back_from_toml(tmp_path: Path, method: str) -> None:
    """Each of JobConfig's fields, written to a TOML file (a value of its own where the method takes one), is
    read back as written: no knob lives only on the command line."""
    own = {"cleave": {"precision": "bf16", "recompute": True, "micro_batches": 2},
           "fedavg": {"lora_rank": 4, "lora_targets": ("c_attn",), "update_clip": 1.0, "local_steps": 3,
                      "aggregate": "median", "own_data": True},
           "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9, "compress": "int8", "max_staleness": 1},
           "split": {"split_layers": 1, "round_timeout_s": 30.0}}[method]
    own = {k: v for k, v in own.items() if k in JobConfig.model_fields}
    job = JobConfig.build(job_id=f"every-{method}", method=method, preset="tiny", steps=7, batch_size=4, seq_len=32,
                          lr=1e-3, lr_schedule="constant", warmup_steps=1, lr_min=1e-4, weight_decay=0.05,
                          beta1=0.8, beta2=0.9, grad_clip=0.5, seed=3, sampling="epochs", val_fraction=0.2,
                          val_every=2, **own)
    body = "\n".join(f"{k} = {toml_value(v)}" for k, v in job.model_dump().items() if v is not None)
    path = tmp_path / "job.toml"
    path.write_text(body + "\n")
    assert JobConfig.load(path) == job
    assert set(job.model_dump()) == set(JobConfig.model_fields)
