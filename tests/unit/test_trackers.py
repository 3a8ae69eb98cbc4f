"""`--log-to`: a run's metrics lines in TensorBoard (read back by the tensorboard package) and the errors a
user sees for a bad spec or a missing package."""

from __future__ import annotations

import pytest

from cleave.errors import ConfigError
from cleave.runtime import trackers

LINES = [
    {"step": 0, "loss": 4.5, "step_time_s": 0.5, "tokens": 1024, "lr": 3e-4, "workers": 4, "val_loss": None,
     "bytes_down": 1000, "tiles_resent": 0},
    {"step": 1, "loss": 4.25, "step_time_s": 0.25, "tokens": 1024, "lr": 3e-4, "workers": 3, "val_loss": 4.0,
     "bytes_down": 2000, "tiles_resent": 2},
]


def test_tensorboard_event_files_hold_every_curve_of_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    t = trackers.Trackers([f"tensorboard:{tmp_path}"], run_name="tiny")
    for line in LINES:
        t.log(line)
    t.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    curves = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "time/step_s", "time/tokens_per_s", "fleet/workers", "bytes/down"} <= set(curves)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(0, 4.5), (1, 4.25)]
    assert [(e.step, e.value) for e in acc.Scalars("time/tokens_per_s")] == [(0, 2048.0), (1, 4096.0)]
    assert [e.step for e in acc.Scalars("train/val_loss")] == [1]  # a step without validation has no point


@pytest.mark.parametrize("spec", ["tensorboard", "tensorboard:", "mlflow:x", "wandb"])
def test_a_bad_spec_names_the_choices(spec):
    with pytest.raises(ConfigError, match="expected tensorboard:DIR or wandb:PROJECT"):
        trackers.Trackers([spec])


def test_a_missing_package_says_which_extra_to_install():
    with pytest.raises(ConfigError, match=r"pip install 'cleave-train\[wandb\]'"):
        trackers._need("cleave_no_such_module", "wandb")
