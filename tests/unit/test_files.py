"""Whole-file writes (`cleave.runtime.files.write_atomic`): every file a service or command writes for others
(credentials, stack.json, the monitor's URL, token-file sidecars) goes through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cleave.runtime.files import write_atomic


def test_a_secret_has_its_mode_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        public = write_atomic(tmp_path / "ca.pem", b"cert", 0o644)
    finally:
        os.umask(old)
    secret = write_atomic(tmp_path / "admin.seed", "SU...\n", 0o600)
    assert public.stat().st_mode & 0o777 == 0o644 and public.read_bytes() == b"cert"
    assert secret.stat().st_mode & 0o777 == 0o600 and secret.read_text() == "SU...\n"
    write_atomic(secret, "SU2\n", 0o600)  # over an earlier one
    assert secret.read_text() == "SU2\n" and sorted(p.name for p in tmp_path.iterdir()) == ["admin.seed", "ca.pem"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "stack.json").mkdir()  # the rename onto a folder that holds a file fails
    (tmp_path / "stack.json" / "keep").write_text("old")
    with pytest.raises(OSError):
        write_atomic(tmp_path / "stack.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stack.json"]
    assert (tmp_path / "stack.json" / "keep").read_text() == "old"
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no" / "such" / "folder.json", "{}")
    if Path("/dev/full").exists():  # a full disk: the write itself fails
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "url").write_text("http://old\n")
        real_open = os.open

        def onto_full(path, flags, mode=0o777):  # noqa: ANN001, ANN202 - os.open's signature
            return real_open("/dev/full", os.O_WRONLY) if str(path).endswith(".tmp") else real_open(path, flags, mode)

        monkeypatch.setattr(os, "open", onto_full)
        with pytest.raises(OSError, match="No space left"):
            write_atomic(tmp_path / "full" / "url", "http://new\n")
        monkeypatch.undo()
        assert (tmp_path / "full" / "url").read_text() == "http://old\n"
