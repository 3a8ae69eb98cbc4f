"""What `cleave demo` says about the worker it killed: a recovery the PS measured, tiles finished by copies
(no re-send, so no recovery event), or a worker that held no tiles."""

from __future__ import annotations

import pytest

from cleave_cli.commands import report_recovery


def steps(copied_at_kill: int, recovery: list[dict] | None = None) -> list[dict]:
    lines = [{"step": s, "step_time_s": 0.5, "loss": 3.0, "tiles_copied": 0, "recovery": []} for s in range(6)]
    lines[3].update(step_time_s=1.25, tiles_copied=copied_at_kill, recovery=recovery or [])
    return lines


def test_a_measured_recovery_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    event = {"worker_id": "w1", "cause": "tile_deadline", "detect_s": 0.2, "redispatch_s": 0.001, "complete_s": 0.3}
    report_recovery(steps(0, [event]), {"at_step": 3, "replacement": "worker-5"})
    out = capsys.readouterr().out
    assert "recovery in step 3: w1 went silent (its oldest tile passed its deadline)" in out
    assert "copies" not in out and "held no tiles" not in out


def test_tiles_finished_by_copies_are_not_called_no_tiles(capsys: pytest.CaptureFixture[str]) -> None:
    report_recovery(steps(3), {"at_step": 3, "replacement": "worker-5"})
    out = capsys.readouterr().out
    assert "finished by copies on other workers (3 copied)" in out
    assert "step 3 took 1.25s (+0.75s against the median step)" in out
    assert "held no tiles" not in out


def test_a_worker_without_tiles_is_said_to_hold_none(capsys: pytest.CaptureFixture[str]) -> None:
    report_recovery(steps(0), {"at_step": 3, "replacement": "worker-5"})
    assert "the killed worker held no tiles when it died" in capsys.readouterr().out


def test_the_replacement_is_said_to_be_started_not_to_have_taken_over(capsys: pytest.CaptureFixture[str]) -> None:
    """A short demo ends before the replacement joins: 'worker-5 took its place' was said of a worker that
    never held a tile; and with none started it said 'no replacement took its place'."""
    report_recovery(steps(0), {"at_step": 3, "replacement": "worker-5"})
    assert "worker-5 was started in its place" in capsys.readouterr().out
    report_recovery(steps(0), {"at_step": 5})
    assert "the job ended before a replacement was started" in capsys.readouterr().out
