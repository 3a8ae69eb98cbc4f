"""The `--metrics-out` file: one JSON object per step, the same fields for every way of training."""

from __future__ import annotations

import json
import time
from pathlib import Path

from cleave.schemas import StepMetrics

EXCLUDED = {"job", "method"}  # carried on the bus, not in the per-step file


class MetricsFile:
    """Appends step lines, flushed one by one so a reader (or a crash) sees whole lines only. Never truncated:
    a resumed job appends the steps it adds; a new job sets another job's file aside (`set_aside`), and so does
    a job that resumed from an older checkpoint than its file's last line (`cut_after`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def steps(self) -> set[int]:
        """Steps already in the file (a torn last line is ignored)."""
        if self.path is None or not self.path.exists():
            return set()
        found = set()
        for line in self.path.read_text().splitlines():
            try:
                found.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        return found

    def lines(self) -> list[dict]:
        """The step lines, in step order, each step once (a torn last line is ignored)."""
        if self.path is None or not self.path.exists():
            return []
        found = {}
        for line in self.path.read_text().splitlines():
            try:
                m = json.loads(line)
                found[int(m["step"])] = m
            except (ValueError, KeyError, TypeError):
                continue
        return [found[s] for s in sorted(found)]

    def set_aside(self, job_id: str) -> Path | None:
        """A new job is about to write here: if the file already holds step lines (another job's), rename it
        (`<stem>.before-<job>-<time><suffix>`, never deleted); the new name, or None when nothing was there."""
        if self.path is None or not self.steps():
            return None
        return self._rename(job_id)

    def aside(self, job_id: str) -> set[Path]:
        """The files `set_aside` made of this file for `job_id`."""
        if self.path is None:
            return set()
        return set(self.path.parent.glob(self._aside_name(job_id, "*")))

    def cut_after(self, step: int, job_id: str) -> Path | None:
        """The job goes on after `step`: if the file holds lines of later steps (of checkpoints that did not read
        back), it is set aside whole (as `set_aside` does) and begun anew with its lines up to `step`; the
        set-aside name, or None when there was nothing to cut."""
        lines = self.lines()
        if all(m["step"] <= step for m in lines):
            return None
        kept = self._rename(job_id)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(m) + "\n" for m in lines if m["step"] <= step)
        return kept

    def _aside_name(self, job_id: str, stamp: str) -> str:
        return f"{self.path.stem}.before-{job_id}-{stamp}{self.path.suffix}"

    def _rename(self, job_id: str) -> Path:
        kept = self.path.with_name(self._aside_name(job_id, time.strftime("%Y%m%d-%H%M%S")))
        if kept.exists():  # (twice within a second: a fallback right after a fresh start)
            kept = kept.with_name(f"{kept.stem}-{time.time_ns()}{kept.suffix}")
        self.path.rename(kept)
        return kept

    def write(self, m: StepMetrics) -> None:
        if self.path is None:
            return
        line = json.dumps(m.model_dump(exclude=EXCLUDED)) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
