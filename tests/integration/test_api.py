"""The Python API: the documented example runs as written (a real local stack, real workers, its losses held
against plain PyTorch), and a loop that stops early leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cleave import Job, run

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_example_runs(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("workers 2") == 4 and "largest loss difference" in out.stdout
    assert (tmp_path / "runs" / "api-example" / "metrics.jsonl").is_file()


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
