"""A local stack names its workers after its run dir: any directory name gives ids a worker accepts."""

from __future__ import annotations

import re

import pytest

from cleave.api.fleet import MAX_WORKER_ID, worker_id

ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # as the worker's settings (and every schema naming a worker) require


@pytest.mark.parametrize("name", ["demo-20261206", "exp.1", "my run (2)", "réseau", "", "." * 300, "a" * 300])
def test_any_run_dir_name_gives_a_valid_worker_id(name: str) -> None:
    ids = [worker_id(name, n) for n in (1, 2, 1000)]
    assert all(ID.fullmatch(i) for i in ids)
    assert len(set(ids)) == 3  # distinct within the stack
    assert all(len(i) <= MAX_WORKER_ID for i in ids)


def test_a_valid_name_is_kept_as_it_is() -> None:
    assert worker_id("demo-20261206_1", 3) == "demo-20261206_1-w3"
