"""The `--metrics-out` file: one JSON object per step, the same fields for every way of training."""

from __future__ import annotations

import json
from pathlib import Path

from cleave.schemas import StepMetrics

EXCLUDED = {"job", "method"}  # carried on the bus, not in the per-step file


class MetricsFile:
    """Appends step lines, flushed one by one so a reader (or a crash) sees whole lines only."""

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

    def write(self, m: StepMetrics) -> None:
        if self.path is None:
            return
        line = json.dumps(m.model_dump(exclude=EXCLUDED)) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
