"""What a job is, for resuming it: a PS started under a job id that has state resumes it only as the same job
(`IDENTITY`); its other settings (`steps`, the learning rate and its schedule, timeouts, ...) may change from one
run to the next."""

from __future__ import annotations

import contextlib
import json

from cleave.train.job import PATH_SETTINGS, JobConfig, absolute_spec

# what makes a job the job it is: its model and the order of its data. Any other setting may change on resume.
IDENTITY = ("method", "preset", "init_from", "seq_len", "split_layers", "lora_rank", "lora_alpha", "seed", "data",
            "tokenizer", "batch_size", "val_fraction")


def _fields(config: str) -> dict:
    """A job description's settings (JSON), an absent one at its default, seq_len left open at the block size."""
    raw = json.loads(config)
    fields = {name: raw.get(name, f.default) for name, f in JobConfig.model_fields.items()}
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
