"""An export is staged beside its folder and swapped in whole; a model and its adapter written elsewhere
(`--adapter-out`) are swapped in together: a swap that fails between the two leaves both as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.api.jobs import replacing


def earlier(folder: Path, text: str) -> None:
    folder.mkdir(parents=True)
    (folder / "weights").write_text(text)


def test_a_model_and_its_adapter_elsewhere_are_never_from_two_exports(tmp_path: Path, monkeypatch) -> None:
    model, adapter = tmp_path / "model", tmp_path / "elsewhere" / "adapter"
    earlier(model, "old model")
    earlier(adapter, "old adapter")
    real = Path.rename

    def rename(self: Path, target: Path) -> Path:  # the disk fills between the model's swap and the adapter's
        if self.name.startswith(".adapter.") and self.suffix == ".partial":
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space left"), replacing(model, adapter) as (staged_model, staged_adapter):
        (staged_model / "weights").write_text("new model")
        (staged_adapter / "weights").write_text("new adapter")
    # (the model was swapped in already, and the adapter's swap failed: a new model beside the old adapter)
    assert (model / "weights").read_text() == "old model"
    assert (adapter / "weights").read_text() == "old adapter"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "model"]  # no staging left behind
    assert [p.name for p in adapter.parent.iterdir()] == ["adapter"]

    monkeypatch.undo()
    with replacing(model, adapter) as (staged_model, staged_adapter):
        (staged_model / "weights").write_text("new model")
        (staged_adapter / "weights").write_text("new adapter")
    assert (model / "weights").read_text() == "new model" and (adapter / "weights").read_text() == "new adapter"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "model"]
    assert [p.name for p in adapter.parent.iterdir()] == ["adapter"]


def test_a_first_export_that_fails_leaves_no_folder(tmp_path: Path) -> None:
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    with pytest.raises(KeyboardInterrupt), replacing(model, adapter) as (staged_model, _):
        (staged_model / "weights").write_text("half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
