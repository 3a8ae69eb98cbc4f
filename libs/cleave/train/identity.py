"""What a job is, for resuming it: a PS started under a job id that has state resumes it only as the same job
(`IDENTITY`); its other settings (`steps`, the learning rate and its schedule, timeouts, ...) may change from one
run to the next."""

from __future__ import annotations

import contextlib
import json

from cleave.errors import JobChanged
from cleave.train.job import PATH_SETTINGS, ROUND_METHODS, JobConfig, absolute_spec

# what makes a job the job it is: its model, the order of its data and its privacy noise (the epsilon a DP job
# reports counts every round at one noise). Any other setting may change on resume.
IDENTITY = ("method", "preset", "init_from", "seq_len", "split_layers", "lora_rank", "lora_alpha", "lora_targets",
            "seed", "data", "tokenizer", "batch_size", "val_fraction", "dp_noise")


def _fields(config: str) -> dict:
    """A job description's settings (JSON), an absent one at its default, seq_len left open at the block size."""
    raw = json.loads(config)
    fields = {name: raw.get(name, f.default) for name, f in JobConfig.model_fields.items()}
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}  # (a default, as JSON has it)
    with contextlib.suppress(Exception):  # (a description that no longer validates keeps None)
        fields["seq_len"] = fields["seq_len"] or JobConfig.model_validate(raw).seq
    # (a job recorded before its paths were made absolute: read from where the PS runs, as it was then)
    return {**fields, **{k: absolute_spec(k, fields[k]) for k in PATH_SETTINGS}}


def identity_changes(before: str, after: str) -> list[str]:
    """The settings of `IDENTITY` that differ between two job descriptions (JSON), as 'name: old -> new'."""
    old, new = _fields(before), _fields(after)
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in IDENTITY if old[k] != new[k]]


def other_changes(before: str, after: str) -> dict[str, str]:
    """The other settings that differ (free to change on resume): name -> 'old -> new'."""
    old, new = _fields(before), _fields(after)
    return {k: f"{old[k]!r} -> {new[k]!r}" for k in old if k not in IDENTITY and old[k] != new[k]}


def refusal(job_id: str, before: str, step: int, after: str) -> JobChanged | None:
    """Why job `job_id`, whose state (up to `step`) was of the description `before`, cannot resume as `after`;
    None when it can."""
    changed = identity_changes(before, after)
    if not changed:
        return None
    unit = "round" if json.loads(after).get("method") in ROUND_METHODS else "step"
    return JobChanged(f"job {job_id!r} already has state (up to {unit} {step}) of another model, data order or "
                      f"privacy noise: {'; '.join(changed)}. Resume it with those settings as they were (steps, the "
                      "learning rate and the other settings may change), or use a new job id")
