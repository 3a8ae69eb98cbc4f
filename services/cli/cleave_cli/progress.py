"""Progress of a job for a person: a one-line bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import TextIO

BAR_WIDTH = 24


class ProgressBar:
    def __init__(self, total: int, stream: TextIO = sys.stdout, tty: bool | None = None) -> None:
        self.total, self.stream = total, stream
        self.tty = stream.isatty() if tty is None else tty
        self.recoveries = 0

    def update(self, m: dict) -> None:
        self.recoveries += m.get("recoveries", 0)
        step = m["step"] + 1
        fields = (f"loss {m['loss']:.4f}  {m['step_time_s']:.2f}s/step  workers {m.get('workers', 0)}  "
                  f"resent {m.get('tiles_resent', 0)}  recoveries {self.recoveries}")
        if self.tty:
            done = int(BAR_WIDTH * step / self.total)
            bar = "#" * done + "-" * (BAR_WIDTH - done)
            self.stream.write(f"\r[{bar}] {step}/{self.total}  {fields}\x1b[K")
            if step >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"step {step}/{self.total}  {fields}\n")
        self.stream.flush()
