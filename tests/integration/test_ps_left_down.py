"""How `cleave train`'s local stack (`LocalFleet.follow_ps`) follows its PS to the end: a PS stopped from outside
(SIGTERM: it drains and exits 0) short of the last step is started again and resumes, as the hub's runner does
(the run once ended with status 0 after 15 of 60 steps); a PS replica left down ends the run with its words (the
others waited for it for ever); a worker left down is told on stderr; a worker dead before it joined is started
again at once (the first step waited 60 s for it)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from cleave.api.fleet import LocalFleet
from cleave.api.supervisor import HELD_DOWN_DIR
from cleave.errors import PsEnded
from cleave.train.job import JobConfig

pytestmark = pytest.mark.timeout(300)


def hold_down(fleet: LocalFleet, name: str) -> None:
    """As `cleave chaos kill --name NAME --no-restart` does."""
    (fleet.run_dir / HELD_DOWN_DIR).mkdir(exist_ok=True)
    (fleet.run_dir / HELD_DOWN_DIR / name).touch()
    fleet.stack.kill(name)


def test_a_ps_stopped_from_outside_resumes_and_a_worker_left_down_is_told(tmp_path: Path, capsys) -> None:
    fleet = LocalFleet(tmp_path / "run", 2)
    metrics = tmp_path / "metrics.jsonl"
    try:
        fleet.start()
        fleet.start_ps(JobConfig.build(job_id="stopped", preset="tiny", steps=10, batch_size=2), metrics)
        steps = []
        for m in fleet.follow_ps(metrics, timeout_s=240):
            steps.append(m["step"])
            if m["step"] == 1:
                hold_down(fleet, "worker-2")
            if m["step"] == 3:
                fleet.stack.kill("ps", signal.SIGTERM)  # (`cleave chaos restart --name ps`)
        assert steps == list(range(10)) and fleet.stack.procs["ps"].restarts == 1  # each step once, all of them
        assert "worker-2 stopped with status -9, not restarted: held down" in capsys.readouterr().err
    finally:
        fleet.stop()


def test_a_ps_replica_left_down_ends_the_run_with_its_words(tmp_path: Path) -> None:
    fleet = LocalFleet(tmp_path / "run", 2)
    metrics = tmp_path / "metrics.jsonl"
    try:
        fleet.start()
        fleet.start_ps(JobConfig.build(job_id="replicas", preset="tiny", steps=200, batch_size=4), metrics, replicas=2)
        with pytest.raises(PsEnded, match=r"the parameter server ps-1 exited with -9: .*see .*ps-1.log"):
            for m in fleet.follow_ps(metrics, timeout_s=240):
                if m["step"] == 1:
                    hold_down(fleet, "ps-1")
    finally:
        fleet.stop()


def test_a_worker_dead_before_it_joined_is_started_again_at_once(tmp_path: Path) -> None:
    fleet = LocalFleet(tmp_path / "run", 2)
    try:
        fleet.start(with_fleet=True)
        fleet.stack.kill("worker-1")  # before it measured its links and joined
        started = time.monotonic()
        fleet.wait_joined()  # (waited out JOIN_WAIT_S, 60 s, with one worker short)
        assert time.monotonic() - started < 30 and fleet.stack.procs["worker-1"].restarts == 1
    finally:
        fleet.stop()
