"""Cleave: train foundation models on the idle compute of many small, unreliable edge devices.

The Python API (`cleave.api.jobs` for a job on a stack, `cleave.api.hub` for a hub's jobs), imported when first used so that `import cleave.errors` and the
services stay light:

    from cleave import Job, run
    for m in run(Job(preset="tiny", steps=5), workers=2):
        print(m["step"], m["loss"])
"""

from __future__ import annotations

from typing import Any

API = {  # the names offered here -> their module in cleave.api
    "Job": "jobs", "load_job": "jobs", "run": "jobs", "metrics": "jobs", "run_dir_of": "jobs", "export": "jobs",
    "submit": "hub", "cancel": "hub", "forget": "hub", "status": "hub", "follow": "hub",
}

__all__ = list(API)


def __getattr__(name: str) -> Any:
    if name in API:
        import importlib

        return getattr(importlib.import_module(f"cleave.api.{API[name]}"), name)
    raise AttributeError(f"module 'cleave' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the API's, for a notebook's or an editor's completion (`cleave.<Tab>`)."""
    return sorted({*globals(), *API})
