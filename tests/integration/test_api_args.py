"""The Python API's arguments: a wrong one is named at the call (pydantic's ValidationError, or ConfigError for
a URL, a run dir or a job that cannot be), before anything starts, connects or writes; nothing hangs, and a run
dir that holds another job is left as it was. Against a real nats-server where a hub is needed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from cleave import Job, follow, load_job, metrics, run, status, submit
from cleave import bus as busmod
from cleave.api import hub
from cleave.errors import CleaveError, ConfigError
from cleave.schemas import JOBS_BUCKET, JobRecord


@pytest.mark.parametrize(("call", "says"), [
    (lambda: run(Job(steps=1), workers=0), "workers"),
    (lambda: run(Job(steps=1), workers="2"), "workers"),
    (lambda: run(Job(steps=1), ps_replicas=0), "ps_replicas"),
    (lambda: run("tiny"), "JobConfig"),
    (lambda: submit(Job(steps=1), "nats://127.0.0.1:1", wait_s=-5), "wait_s"),
    (lambda: submit(Job(steps=1), "nats://127.0.0.1:1", wait_s=float("nan")), "wait_s"),
    (lambda: submit(Job(steps=1), "nats://127.0.0.1:1", min_workers="1"), "min_workers"),
    (lambda: status("nats://127.0.0.1:1", job_id="a.b"), "job_id"),
    (lambda: follow("bad id!", "nats://127.0.0.1:1"), "job_id"),
    (lambda: follow("job", "nats://127.0.0.1:1", timeout_s=0), "timeout_s"),
    (lambda: follow("job", "nats://127.0.0.1:1", poll_s=-1), "poll_s"),
    (lambda: Job(beta1=2.0), "beta1"),
    (lambda: Job(seed=2**80), "seed"),
    (lambda: Job(val_fraction=0.0, val_every=1), "val_every"),
    (lambda: Job(lr=1e-3, lr_min=1.0), "lr_min"),
])
def test_a_wrong_argument_is_named_at_the_call(call, says: str) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    with pytest.raises(ValidationError, match=says):
        call()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("url", ["", "http://x", "not a url"])
def test_a_url_nats_cannot_use_is_named_by_every_call(url: str, tmp_path: Path) -> None:
    for call in (lambda: run(Job(steps=1), nats=url, run_dir=tmp_path), lambda: submit(Job(steps=1), url),
                 lambda: status(url), lambda: follow("job", url)):
        with pytest.raises(ConfigError, match="expected nats://HOST:PORT"):
            call()


def test_a_run_on_a_nats_that_does_not_answer_is_refused_before_the_ps_starts(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "DEFAULT_CONNECT_TIMEOUT_S", 3.0)  # (a hub not up is retried for 15 s by default)
    with pytest.raises(CleaveError, match="could not reach NATS at nats://127.0.0.1:1 within 3s"):
        run(Job(steps=1), nats="nats://127.0.0.1:1", run_dir=tmp_path)
    assert not (tmp_path / "job.json").exists() and not (tmp_path / "logs").exists()


def test_a_run_dir_holding_another_job_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text(Job(job_id="first").model_dump_json())
    before = (tmp_path / "job.json").read_text()
    for reference in (False, True):
        with pytest.raises(ConfigError, match="holds job 'first'"):
            run(Job(job_id="second", steps=1), run_dir=tmp_path, reference=reference)
    assert (tmp_path / "job.json").read_text() == before and not (tmp_path / "metrics.jsonl").exists()


def test_metrics_of_no_run_dir_is_an_error_and_of_a_new_one_is_empty(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no run dir"):
        metrics(tmp_path / "nowhere")
    assert metrics(tmp_path) == []


def test_an_override_of_none_keeps_the_files_value(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('preset = "tiny"\nsteps = 2\n')
    assert load_job(path, steps=None).steps == 2 and load_job(path, steps=5).steps == 5


def test_follow_gives_up_at_its_deadline_however_long_its_poll(nats_url: str) -> None:
    """A job that stays queued: `follow` ends at `timeout_s`, not after a poll period of 1,000 s."""

    async def queue_a_job() -> None:
        bus = await busmod.connect(nats_url, "test")
        await bus.setup()
        await bus.kv_put(await bus.kv(JOBS_BUCKET), "waiting",
                         JobRecord(job_id="waiting", job=json.dumps({}), state="queued", submitted_at=time.time()))
        await bus.close()

    asyncio.run(queue_a_job())
    t0 = time.monotonic()
    with pytest.raises(CleaveError, match="did not end within 3"):
        list(follow("waiting", nats_url, poll_s=1000, timeout_s=3))
    assert time.monotonic() - t0 < 30
