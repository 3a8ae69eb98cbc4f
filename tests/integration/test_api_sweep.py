"""The Python API against a new user's mistakes: data the job cannot train on, settings a local stack can never
run, a run dir in use, a loop stopped early. Each is told at the call or ends the run with nothing left running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cleave import Job, run
from cleave.errors import ConfigError


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
