"""The Python API: the documented example runs as written (a real local stack, real workers, its losses held
against plain PyTorch), and a loop that stops early leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from cleave import Job, follow, metrics, run, status, submit
from cleave.api.fleet import LocalFleet
from cleave.errors import EXIT_ERROR, CleaveError, JobChanged, PsEnded

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_example_runs(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("workers 2") == 4 and "largest loss difference" in out.stdout
    assert (tmp_path / "runs" / "api-example" / "metrics.jsonl").is_file()
    assert "exported api-example after step 3" in out.stdout
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "api-example" / "model")
    assert model.config.n_layer == Job(preset="tiny").arch().n_layer
    # run again, as a reader does: the job is done, so it trains nothing, and checks and exports the same steps
    # (it ended in a traceback: 'zip() argument 2 is longer than argument 1')
    again = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "workers 2" not in again.stdout and "largest loss difference against plain PyTorch" in again.stdout
    assert "exported api-example after step 3" in again.stdout


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


@pytest.mark.slow  # ~25 s
def test_a_loop_that_breaks_stops_the_stack(tmp_path: Path) -> None:
    steps = run(Job(job_id="api-break", preset="tiny", steps=50, batch_size=2), workers=2, run_dir=tmp_path)
    first = next(steps)
    assert first["step"] == 0
    pids = [p["pid"] for p in json.loads((tmp_path / "stack.json").read_text())["processes"]]
    assert pids and all(alive(p) for p in pids)
    steps.close()  # what leaving a for loop early does once the generator is dropped
    assert not [p for p in pids if alive(p)]
    # a generator kept in a variable, left unfinished: the stack stayed up until the interpreter's teardown,
    # whose late stop failed ('Exception ignored ... sys.meta_path is None') and left stack.json saying running
    script = ("import sys\nfrom cleave import Job, run\n"
              "g = run(Job(preset='tiny', steps=50, batch_size=2), workers=1, run_dir=sys.argv[1])\n"
              "for m in g:\n    break\n")
    kept = subprocess.run([sys.executable, "-c", script, str(tmp_path / "kept")], capture_output=True, text=True,
                          timeout=120)
    assert kept.returncode == 0 and "Exception ignored" not in kept.stderr, kept.stderr[-2000:]
    procs = json.loads((tmp_path / "kept" / "stack.json").read_text())["processes"]
    assert procs and not [p for p in procs if p["running"] or alive(p["pid"])]


def start_up(run_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`cleave up` with `flags` in `run_dir`, and its NATS URL once its stack.json names it."""
    up = subprocess.Popen([sys.executable, "-m", "cleave_cli", "up", *flags, "--run-dir", str(run_dir)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack = run_dir / "stack.json"
    for _ in range(600):
        if stack.is_file() and json.loads(stack.read_text()).get("nats_url"):
            break
        time.sleep(0.1)
    return up, json.loads(stack.read_text())["nats_url"]


def scheduler_chunks(run_dir: Path) -> str | None:
    """The chunks the scheduler of the stack in `run_dir` took (its `scheduler_started` line; a forked service's
    environment is not the one /proc shows)."""
    log = run_dir / "logs" / "scheduler.log"
    for _ in range(1200):
        said = [x for x in (log.read_text(errors="replace") if log.exists() else "").splitlines()
                if "scheduler_started" in x]
        if said:
            return next((w.split("=", 1)[1] for w in said[-1].split() if w.startswith("chunks=")), None)
        time.sleep(0.1)
    raise AssertionError(f"the scheduler did not start: {log}")


def test_a_stack_on_this_machine_sends_whole_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cleave up` without --listen, and the stack `run` starts, give the scheduler chunks 1: every worker is on
    this machine (tests/unit/test_one_machine.py: an environment or settings file that sets chunks wins)."""
    monkeypatch.delenv("CLEAVE_SCHEDULER_CHUNKS", raising=False)
    monkeypatch.delenv("CLEAVE_CONFIG", raising=False)
    up, _ = start_up(tmp_path / "up", "--workers", "0")
    try:
        assert scheduler_chunks(tmp_path / "up") == "1"
    finally:
        up.terminate()
        up.wait(60)
    steps = run(Job(job_id="api-chunks", preset="tiny", steps=50, batch_size=2), workers=1, run_dir=tmp_path / "run")
    try:
        next(steps)
        assert scheduler_chunks(tmp_path / "run") == "1"
    finally:
        steps.close()


def test_a_stack_in_a_run_dir_of_any_name_trains_and_a_worker_that_cannot_start_is_reported(tmp_path: Path) -> None:
    """The workers are named after the run dir: a dot or a space in it once made every worker refuse its id, and
    the PS waited for workers forever. A worker that refuses its settings now ends the wait with its own words."""
    steps = list(run(Job(job_id="api-dots", preset="tiny", steps=2, batch_size=2), workers=1,
                     run_dir=tmp_path / "exp.1 (b)"))
    assert [m["step"] for m in steps] == [0, 1]
    fleet = LocalFleet(tmp_path / "bad", 1, worker_env={"CLEAVE_WORKER_THREADS": "0"})
    fleet.start()
    try:
        with pytest.raises(CleaveError, match=r"worker-1 could not start: .*threads"):
            fleet.wait_joined(timeout_s=60)
    finally:
        fleet.stop()


def test_a_changed_job_is_refused_before_its_settings_are_recorded(tmp_path: Path) -> None:
    """The same job id with another seed: refused before a PS starts, the run dir's job.json still the job that
    ran (it was once rewritten with the refused settings), its metrics untouched; the job itself resumes."""
    run_dir = tmp_path / "run"
    assert [m["step"] for m in run(Job(job_id="api-same", preset="tiny", steps=1, batch_size=2), workers=1,
                                   run_dir=run_dir)] == [0]
    recorded, written = (run_dir / "job.json").read_text(), (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(JobChanged, match=r"up to step 0\) of another model.*seed: 0 -> 7"):
        list(run(Job(job_id="api-same", preset="tiny", steps=2, batch_size=2, seed=7), workers=1, run_dir=run_dir))
    assert (run_dir / "job.json").read_text() == recorded and (run_dir / "metrics.jsonl").read_text() == written
    assert "ps" not in {p["name"] for p in json.loads((run_dir / "stack.json").read_text())["processes"]}
    more = run(Job(job_id="api-same", preset="tiny", steps=2, batch_size=2), workers=1, run_dir=run_dir)
    assert [m["step"] for m in more] == [1]  # the step it trains now (the earlier run's was yielded again as new)
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]  # the run dir's file holds both


def test_a_ps_that_refuses_its_job_stops_the_run_with_its_own_words(tmp_path: Path) -> None:
    """A job whose data cannot be read: the PS exits 2 at its start. Restarted, it would refuse again for ever
    (the run hung, silent); it stays down, and the run raises its words with its status (`cleave train` ends 2)."""
    corpus = tmp_path / "corpus.txt"  # (there when `run` checks the job's data, gone when the PS reads it)
    corpus.write_text("Some text to train on. " * 20_000)
    job = Job(job_id="api-nodata", preset="tiny", steps=2, batch_size=2, data=str(corpus))
    start = time.monotonic()
    steps = run(job, workers=1, run_dir=tmp_path / "run")
    corpus.unlink()
    with pytest.raises(PsEnded, match=r"exited with 2: data=.*corpus.txt.*cannot read") as ended:
        list(steps)
    assert ended.value.exit_code == EXIT_ERROR and time.monotonic() - start < 60
    stack = json.loads((tmp_path / "run" / "stack.json").read_text())
    ps = next(p for p in stack["processes"] if p["name"] == "ps")
    assert ps["restarts"] == 0, ps


@pytest.mark.slow  # ~60 s
def test_a_job_submitted_to_a_hub_is_followed_to_its_end(tmp_path: Path) -> None:
    """`cleave up` (a hub without auth: its runner, scheduler and two workers); from Python: submit, follow each
    step to the end (the losses of plain PyTorch), and the hub's status says done."""
    up, url = start_up(tmp_path / "hub", "--workers", "2")
    try:
        job = Job(job_id="api-hub", preset="tiny", steps=3, batch_size=2)
        rec = submit(job, url, min_workers=2, wait_s=120)
        assert rec is not None and rec.state in ("queued", "running", "done")
        got = [m["loss"] for m in follow(job.job_id, url, poll_s=0.5, timeout_s=300)]
        want = [m["loss"] for m in run(job, reference=True, run_dir=tmp_path / "reference")]
        assert got == pytest.approx(want, abs=1e-4)
        (view,) = status(url, job_id=job.job_id)
        assert view["state"] == "done" and view["steps_reported"] == 3
    finally:
        up.terminate()
        up.wait(60)


@pytest.mark.slow  # ~60 s
def test_cleave_train_logs_its_ps_in_to_a_hub_with_auth(tmp_path: Path) -> None:
    """`cleave train --nats URL --auth DIR` against `cleave up --auth DIR` (credentials and TLS): the PS logs in
    with the PS credential and trains on the hub's workers."""
    auth = tmp_path / "auth"
    subprocess.run([sys.executable, "-m", "cleave_cli", "auth", "init", "--out", str(auth), "--tls"], check=True,
                   capture_output=True, timeout=120)
    up, url = start_up(tmp_path / "hub", "--auth", str(auth), "--workers", "2")
    try:
        train = [sys.executable, "-m", "cleave_cli", "train", "--nats", url, "--preset", "tiny", "--steps", "2",
                 "--workers", "2"]
        out = subprocess.run([*train, "--auth", str(auth), "--job-id", "with-auth", "--run-dir",
                              str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    finally:
        up.terminate()
        up.wait(60)


def test_submit_says_the_job_is_stored_before_it_waits_for_the_runner(nats_url: str) -> None:
    """A Ctrl-C while `cleave submit` waited for the runner's answer exited 130 without a word, although the
    hub had the job and ran it later: the submitter now hears that it is stored before the wait."""
    import asyncio

    from cleave import bus as busmod
    from cleave_cli.runner import jobs_stream

    async def hub_without_runner() -> None:
        bus = await busmod.connect(nats_url, "setup")
        try:
            await bus.setup()
            await jobs_stream(bus)
        finally:
            await bus.close()

    asyncio.run(hub_without_runner())
    said: list[str] = []
    assert submit(Job(job_id="queued", preset="tiny", steps=1), nats=nats_url, wait_s=0.5,
                  on_stored=lambda: said.append("stored")) is None  # no runner answered
    assert said == ["stored"]
    done = subprocess.run([sys.executable, "-m", "cleave_cli", "submit", "--nats", nats_url, "--preset", "tiny",
                           "--steps", "1", "--job-id", "queued2", "--wait", "0.5"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "queued2: stored on the hub; waiting up to 0.5s for its runner's answer" in done.stderr, done.stderr
