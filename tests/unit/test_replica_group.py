"""The PS replica group's pure parts: the job check's wording, each replica's share of a batch."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import ConfigError
from cleave.train.job import JobConfig
from cleave_ps.jobs.replicas import ReplicaGroup, fingerprint, job_differences


def test_job_differences_name_each_field():
    a = fingerprint(JobConfig(job_id="j", seed=0).model_dump_json(), 2)
    b = fingerprint(JobConfig(job_id="j", seed=3, data="x.txt").model_dump_json(), 2)
    assert job_differences(a, a) == []
    assert job_differences(b, a) == ["data: 'x.txt' here, 'builtin' at replica 0", "seed: 3 here, 0 at replica 0"]
    c = fingerprint(JobConfig(job_id="j").model_dump_json(), 4)
    assert job_differences(c, a) == ["ps_replicas: 4 here, 2 at replica 0"]


def test_shares_cover_the_batch_once():
    x = torch.arange(8 * 3).view(8, 3)  # (B, T)
    parts = [ReplicaGroup(r, 4).share(x) for r in range(4)]
    assert all(p.shape == (2, 3) for p in parts)
    assert torch.equal(torch.cat(parts), x)


def test_an_index_outside_the_group_is_refused():
    with pytest.raises(ConfigError, match="replica=2 is outside the group of replicas=2"):
        ReplicaGroup(2, 2)
