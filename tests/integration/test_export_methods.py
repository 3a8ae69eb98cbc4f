"""`cleave export` of jobs beyond a plain run on a local stack: split learning (no whole model to export), a job
trained on a running stack's NATS exported by its own run dir, against a real `cleave up` stack."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleave import Job, run
from cleave.api import jobs
from cleave.errors import ConfigError
from tests.integration.test_api import start_up

SPLIT, LORA = "x-split", "x-lora"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A `cleave up` stack with one worker, a split-learning job and a LoRA job trained on it (`run(nats=...)`,
    as `cleave train --nats`), each in a run dir of its own; the NATS URL and the folder of those run dirs."""
    root = tmp_path_factory.mktemp("hub")
    up, url = start_up(root / "up", "--workers", "1")
    try:
        for job in (Job(job_id=SPLIT, preset="tiny", method="split", steps=1, batch_size=2),
                    Job(job_id=LORA, preset="tiny", method="fedavg", lora_rank=4, local_steps=1, steps=1,
                        batch_size=2)):
            assert [m["step"] for m in run(job, nats=url, run_dir=root / job.job_id)] == [0]
        yield url, root
    finally:
        up.terminate()
        up.wait(60)


def test_a_split_job_says_why_it_has_no_model_to_export(hub: tuple[str, Path], tmp_path: Path) -> None:
    """Its PS keeps only its half of the model: the export failed on the missing keys ('checkpoint of step 0 does
    not fit this model: keys [blocks.0...]')."""
    url, _ = hub
    with pytest.raises(ConfigError, match=f"job '{SPLIT}' is split learning .* the embeddings and block 0 are the "
                                          "client worker's, .* no whole model to export"):
        jobs.export(tmp_path / "hf", nats=url, job_id=SPLIT)
    assert not (tmp_path / "hf").exists()


def test_the_run_dir_of_a_job_trained_on_a_running_stack_names_where_its_state_is(hub: tuple[str, Path],
                                                                                   tmp_path: Path) -> None:
    """`cleave train --nats` keeps the job's state on that NATS, not in its run dir: the export said only that the
    run dir had no running NATS and no JetStream store."""
    url, root = hub
    with pytest.raises(ConfigError, match=re.escape(f"trained on the NATS at {url}, which keeps the job's state: "
                                                    f"export it from there (cleave export --nats {url} --job-id "
                                                    f"{LORA} --out OUT")):
        jobs.export(tmp_path / "hf", run_dir=root / LORA)
    assert jobs.export(tmp_path / "hf", nats=url, job_id=LORA).head.step == 0  # (where the message points)
