"""Deterministic fault injection for tests and chaos drills (after torchft's fail_at).

A spec such as "before_commit:3,tile:5" names points in a service's code and the step at which the
process kills itself there with SIGKILL, exactly as an operator's `kill -9` would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from cleave.errors import ConfigError
from cleave.schemas.base import checked_str

# the points each service's code calls `hit` at: a spec naming another would never fire
PS_POINTS = ("before_commit", "mid_commit", "after_commit", "in_step", "in_round")
WORKER_POINTS = ("tile", "round", "secagg_masked", "split")


def parse(spec: str, known: tuple[str, ...] | None = None) -> dict[str, int]:
    """A spec's points and steps; a malformed entry, or a point not in `known`, is a ConfigError naming it."""
    points: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, step = part.partition(":")
        if not name or not step.isdigit():
            raise ConfigError(f"fail_at entry {part!r} must look like POINT:STEP, e.g. before_commit:3")
        if known is not None and name not in known:
            raise ConfigError(f"fail_at point {name!r} is unknown here; known: {', '.join(known)}")
        points[name] = int(step)
    return points


def spec_type(known: tuple[str, ...]) -> Any:  # noqa: ANN401 - an Annotated type for a settings field
    """A settings field's type: a spec of `known` points, checked when the settings are read."""
    return checked_str(lambda spec: parse(spec, known))


class Faults:
    """`marker_dir`, when given, makes each fault fire once across restarts of the process."""

    def __init__(self, spec: str = "", marker_dir: Path | None = None, tag: str = "") -> None:
        self.marker_dir, self.tag = marker_dir, tag
        self.points = parse(spec)

    def hit(self, point: str, step: int) -> None:
        """Die here, now, if the spec says so."""
        if self.points.get(point) != step:
            return
        if self.marker_dir is not None:
            marker = self.marker_dir / f"fault-{point}-{step}-{self.tag}"
            if marker.exists():
                return
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
