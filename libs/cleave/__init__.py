"""Cleave: train foundation models on the idle compute of many small, unreliable edge devices.

The Python API (`cleave.api.jobs`), imported when first used so that `import cleave.errors` and the
services stay light:

    from cleave import Job, run
    for m in run(Job(preset="tiny", steps=5), workers=2):
        print(m["step"], m["loss"])
"""

from __future__ import annotations

from typing import Any

API = ("Job", "load_job", "run", "metrics", "run_dir_of")  # names of cleave.api.jobs offered here

__all__ = list(API)


def __getattr__(name: str) -> Any:
    if name in API:
        from cleave.api import jobs

        return getattr(jobs, name)
    raise AttributeError(f"module 'cleave' has no attribute {name!r}")
