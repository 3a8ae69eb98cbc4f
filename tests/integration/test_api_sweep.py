"""The Python API against a new user's mistakes: data the job cannot train on, settings a local stack can never
run, a run dir in use, a loop stopped early. Each is told at the call or ends the run with nothing left running."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleave import Job, export, metrics, run
from cleave.api.stack import hold
from cleave.errors import CleaveError, ConfigError


@pytest.mark.parametrize("reference", [False, True])
def test_data_that_is_no_text_or_too_short_is_refused_at_the_call(tmp_path: Path, reference: bool) -> None:
    """As `cleave train` and its dry run refuse them: binary data (it trained a model on noise) and text too short
    to train on (the PS refused it once a stack had started), with nothing started or written."""
    (tmp_path / "scan.pdf").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "hello.txt").write_text("hello world\n")
    for data, says in (("scan.pdf", "looks binary"), ("hello.txt", "has 12 tokens; need at least 4096")):
        run_dir = tmp_path / f"run-{data}"
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=says):
            run(Job(job_id="api-data", preset="tiny", steps=2, batch_size=2, data=str(tmp_path / data)),
                workers=1, run_dir=run_dir, reference=reference)
        assert time.monotonic() - t0 < 10 and not run_dir.exists()


@pytest.mark.parametrize(("settings", "args", "says"), [
    ({}, {"workers": 1, "ps_replicas": 2}, "ps_replicas=2 .* needs at least as many workers"),  # (waited for ever)
    ({"method": "diloco", "min_updates": 3}, {"workers": 2}, "no round could ever apply"),  # (trained nothing)
    ({"method": "fedavg", "secagg": True}, {"workers": 1}, "secagg .* needs at least 2 workers"),
    ({"method": "diloco", "own_data": True}, {"workers": 1}, "a local stack's workers declare none"),
    ({"batch_size": 3}, {"workers": 2, "ps_replicas": 2}, "batch size divisible"),
])
def test_settings_a_local_stack_cannot_run_are_refused_at_the_call(tmp_path: Path, settings: dict, args: dict,
                                                                   says: str) -> None:
    """As `cleave train` refuses them: before, a PS replica with no worker waited for ever, a round that could
    never apply an update trained nothing at every step, and the rest failed in the PS 10-30 s later."""
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=says):
        run(Job(preset="tiny", steps=2, **{"batch_size": 4, **settings}), run_dir=tmp_path / "run", **args)
    assert time.monotonic() - t0 < 10 and not (tmp_path / "run").exists()


# Ctrl-C in the loop, and again while the stack stops (the second lands at the stack's first SIGTERM to a child)
INTERRUPTED_TWICE = """
import json, os, signal, subprocess, sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell that starts commands in the background ignores it)
from cleave import Job, export, metrics, run
from cleave.api.stack import hold
from cleave.api.stack import hold
terminate = subprocess.Popen.terminate
def terminate_pressed(self):
    subprocess.Popen.terminate = terminate
    os.kill(os.getpid(), signal.SIGINT)
    terminate(self)
run_dir = Path(sys.argv[1])
try:
    for m in run(Job(job_id="api-twice", preset="tiny", steps=100, batch_size=2), workers=1, run_dir=run_dir):
        subprocess.Popen.terminate = terminate_pressed
        os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    pass
procs = json.loads((run_dir / "stack.json").read_text())["processes"]
running = [p["name"] for p in procs if Path(f"/proc/{p['pid']}").exists()
           and Path(f"/proc/{p['pid']}/stat").read_text().split(") ")[1][0] != "Z"]
os.close(hold(run_dir))  # (raises while a stack holds it)
print(json.dumps(running))
"""


def test_ctrl_c_twice_stops_the_whole_stack(tmp_path: Path) -> None:
    """A notebook's interrupt pressed again while the stack stopped: nats-server (and the PS) ran on, with the run
    dir free for another stack on the same store, until the kernel exited. The stop now runs to its end."""
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_TWICE, str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_a_run_dir_held_by_this_process_says_so(tmp_path: Path) -> None:
    """A run's steps kept in a variable and left unfinished hold its run dir (its stack runs on): a second run
    there named 'another cleave (pid N)', N being the notebook's own kernel; it now says so, and what to close."""
    job = Job(job_id="api-held", preset="tiny", steps=50, batch_size=2)
    steps = run(job, workers=1, run_dir=tmp_path)
    next(steps)
    try:
        with pytest.raises(CleaveError, match=r"is this process: a `run\(...\)` kept in a variable"):
            next(run(job, workers=1, run_dir=tmp_path))
    finally:
        steps.close()
    os.close(hold(tmp_path))  # (free again)


def test_metrics_of_a_metrics_file_names_the_mistake(tmp_path: Path) -> None:
    """`metrics` given the metrics file itself (or one named with metrics_out=): it said 'no such folder' of a file
    that was there."""
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a run dir"):
        metrics(tmp_path / "metrics.jsonl")


def test_a_run_and_its_export_work_where_an_event_loop_runs(tmp_path: Path) -> None:
    """A Jupyter notebook runs its cells in its kernel's event loop: there `run` and `export` raised RuntimeError
    (asyncio.run() cannot be called from a running event loop) before a step was trained."""

    async def cell() -> tuple[list[int], int]:
        job = Job(job_id="api-cell", preset="tiny", steps=1, batch_size=2)
        steps = [m["step"] for m in run(job, workers=1, run_dir=tmp_path / "run")]
        return steps, export(tmp_path / "model", run_dir=tmp_path / "run").head.step

    assert asyncio.run(cell()) == ([0], 0)


def test_the_hubs_client_works_where_an_event_loop_runs_and_on_a_server_with_no_hub(nats_url: str) -> None:
    """`status`, `submit` and `follow` raised RuntimeError in a notebook's cell; `follow` on a NATS server no
    hub ever ran on raised nats-py's NotFoundError (stream not found)."""
    from cleave import follow, status  # noqa: PLC0415

    async def cell() -> list[dict]:
        return status(nats_url)

    assert asyncio.run(cell()) == []
    with pytest.raises(CleaveError, match="knows no job 'nowhere'"):
        next(follow("nowhere", nats_url))
