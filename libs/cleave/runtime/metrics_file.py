"""The `--metrics-out` file: one JSON object per step, the same fields for every way of training."""

from __future__ import annotations

import json
import time
from pathlib import Path

from cleave.schemas import StepMetrics

EXCLUDED = {"job", "method"}  # carried on the bus, not in the per-step file


class MetricsFile:
    """Appends step lines, flushed one by one so a reader (or a crash) sees whole lines only. Never truncated:
    a resumed job appends the steps it adds; a new job sets another job's file aside (`set_aside`)."""

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

    def set_aside(self, job_id: str) -> Path | None:
        """A new job is about to write here: if the file already holds step lines (another job's), rename it
        (`<stem>.before-<job>-<time><suffix>`, never deleted); the new name, or None when nothing was there."""
        if self.path is None or not self.steps():
            return None
        kept = self.path.with_name(f"{self.path.stem}.before-{job_id}-{time.strftime('%Y%m%d-%H%M%S')}{self.path.suffix}")
        self.path.rename(kept)
        return kept

    def write(self, m: StepMetrics) -> None:
        if self.path is None:
            return
        line = json.dumps(m.model_dump(exclude=EXCLUDED)) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
