"""A fleet on one machine (`cleave demo`, `cleave train` on its own stack, `cleave up` without --listen) has the
scheduler send planned blocks whole, unless the environment or the settings file's [scheduler] table sets chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.api.fleet import CHUNKS_ENV, one_machine_chunks
from cleave.runtime.config_file import CONFIG_ENV
from cleave_scheduler.settings import SchedulerSettings


@pytest.fixture(autouse=True)
def bare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHUNKS_ENV, raising=False)
    monkeypatch.delenv(CONFIG_ENV, raising=False)


def scheduler_chunks(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> int:
    """The chunks a scheduler started with `env` over this process's environment reads."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return SchedulerSettings().chunks


def test_whole_blocks_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert one_machine_chunks() == {CHUNKS_ENV: "1"}
    assert scheduler_chunks(one_machine_chunks(), monkeypatch) == 1


def test_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNKS_ENV, "8")
    assert one_machine_chunks() == {}
    assert scheduler_chunks(one_machine_chunks(), monkeypatch) == 8


def test_the_settings_file_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = tmp_path / "cleave.toml"
    settings.write_text("[scheduler]\nchunks = 2\n")
    monkeypatch.setenv(CONFIG_ENV, str(settings))
    assert one_machine_chunks() == {}
    assert scheduler_chunks(one_machine_chunks(), monkeypatch) == 2


def test_a_settings_file_without_chunks_leaves_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = tmp_path / "cleave.toml"
    settings.write_text("[scheduler]\nplanner = \"even\"\n")
    monkeypatch.setenv(CONFIG_ENV, str(settings))
    assert scheduler_chunks(one_machine_chunks(), monkeypatch) == 1


def test_a_scheduler_key_that_is_no_table_is_left_to_the_scheduler(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    settings = tmp_path / "cleave.toml"
    settings.write_text("scheduler = 3\n")
    monkeypatch.setenv(CONFIG_ENV, str(settings))
    assert one_machine_chunks() == {CHUNKS_ENV: "1"}  # no crash here: the scheduler's settings name the error
