"""The progress line a person reads: the metrics' own step number, how many are done, tokens a second and an
ETA at the recent pace; a round method's steps are rounds."""

from __future__ import annotations

import io

from cleave_cli.progress import ProgressBar, duration, unit_of


def line(step: int, t: float = 0.5) -> dict:
    return {"step": step, "loss": 4.0 - step / 10, "step_time_s": t, "tokens": 2048, "workers": 4,
            "tiles_resent": 1, "recoveries": step % 2}


def test_a_line_names_the_metrics_step_the_count_done_the_rate_and_the_eta():
    out = io.StringIO()
    bar = ProgressBar(30, out, tty=False)
    for s in range(16):
        bar.update(line(s))
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("step 15 (16/30)  loss 2.5000  0.50s/step  4,096 tok/s  ETA 7s  workers 4")
    assert last.endswith("recoveries 8")
    bar.update(line(29))
    assert "ETA" not in out.getvalue().splitlines()[-1]  # done: no time left to show


def test_the_eta_follows_the_recent_pace():
    bar = ProgressBar(100, io.StringIO(), tty=False)
    for s in range(10):
        bar.line(line(s, 1.0))
    assert "ETA 2m40s" in bar.line(line(10, 9.0))  # the mean of the last 10 (1.8 s) x 89 steps left


def test_rounds_are_called_rounds():
    assert (unit_of("diloco"), unit_of("fedavg"), unit_of("cleave"), unit_of("split")) == ("round", "round", "step", "step")
    text = ProgressBar(8, io.StringIO(), tty=False, unit="round").line(line(2))
    assert text.startswith("round 2 (3/8)") and "s/round" in text and "applied" not in text
    # a round that left the weights as they were says so (it read as any other)
    kept = ProgressBar(8, io.StringIO(), tty=False, unit="round").line({**line(3), "applied": False})
    assert kept.endswith("not applied (fewer updates than --min-updates)")


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0, 42.4, 425, 10_920)] == ["0s", "42s", "7m05s", "3h02m"]


def test_a_dp_job_shows_the_epsilon_it_has_spent():
    """A DP job's epsilon was only in its metrics file; past the accountant's bound it is that bound, said so."""
    bar = ProgressBar(8, io.StringIO(), tty=False, unit="round")
    assert bar.line({**line(2), "dp_epsilon": 8.38541}).endswith("recoveries 0  epsilon 8.385")
    assert bar.line({**line(3), "dp_epsilon": 1e4, "applied": False}).endswith(
        "epsilon >= 10000  not applied (fewer updates than --min-updates)")
    assert "epsilon" not in bar.line({**line(4), "dp_epsilon": None})
