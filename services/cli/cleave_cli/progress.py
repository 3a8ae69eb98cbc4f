"""Progress of a job for a person: a one-line bar on a terminal, plain lines otherwise.

A step (a round, for DiLoCo and FedAvg) is named by its number in the metrics (`step`, from 0), the same
number the logs, the demo's report, `cleave status`, the export and the dashboard use; the bar shows how many
are done of how many (`step 15 (16/30)`), the throughput a trainer reads first (tokens a second) and when the
job should end at the recent pace.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import TextIO

from cleave.schemas import MAX_EPSILON

BAR_WIDTH = 24
PACE_STEPS = 10  # the ETA follows the mean of this many recent step times
ROUND_METHODS = ("diloco", "fedavg")


def unit_of(method: str) -> str:
    """What one `step` of the metrics is for a person: a round for the round methods, else a step."""
    return "round" if method in ROUND_METHODS else "step"


def duration(seconds: float) -> str:
    """'42s', '7m05s', '3h02m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def spent(m: dict) -> str | None:
    """'epsilon 4.377' for a DP job's metrics line (the epsilon spent up to it); None for another job's."""
    eps = m.get("dp_epsilon")
    if eps is None:
        return None
    return f"epsilon >= {MAX_EPSILON:.0f}" if eps >= MAX_EPSILON else f"epsilon {eps:.4g}"


class ProgressBar:
    def __init__(self, total: int, stream: TextIO = sys.stdout, tty: bool | None = None, unit: str = "step") -> None:
        self.total, self.stream, self.unit = total, stream, unit
        self.tty = stream.isatty() if tty is None else tty
        self.recoveries = 0
        self.recent: deque[float] = deque(maxlen=PACE_STEPS)

    def line(self, m: dict) -> str:
        """The text after the bar for metrics line `m`."""
        self.recoveries += m.get("recoveries", 0)
        self.recent.append(m["step_time_s"])
        done = m["step"] + 1
        pace = sum(self.recent) / len(self.recent)
        rate = f"{m['tokens'] / m['step_time_s']:,.0f} tok/s  " if m.get("tokens") and m["step_time_s"] > 0 else ""
        eta = f"ETA {duration(pace * (self.total - done))}  " if done < self.total else ""
        tail = [e for e in (spent(m), "not applied (fewer updates than --min-updates)" if m.get("applied") is False
                            else None) if e]
        return (f"{self.unit} {m['step']} ({done}/{self.total})  loss {m['loss']:.4f}  {m['step_time_s']:.2f}s/{self.unit}"
                f"  {rate}{eta}workers {m.get('workers', 0)}  resent {m.get('tiles_resent', 0)}  "
                f"recoveries {self.recoveries}" + "".join(f"  {e}" for e in tail))

    def update(self, m: dict) -> None:
        text, done = self.line(m), m["step"] + 1
        if self.tty:
            filled = int(BAR_WIDTH * done / self.total)
            self.stream.write(f"\r[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {text}\x1b[K")
            if done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
