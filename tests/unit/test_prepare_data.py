"""`cleave prepare-data` as a user meets it: what it refuses and why, what it reads, what it prints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cleave.errors import ConfigError
from cleave.models.tokenizer import ByteTokenizer
from cleave.train import sources

BYTES = ByteTokenizer()


def test_a_hidden_out_inside_a_folder_source_is_not_refused(tmp_path: Path) -> None:
    """A folder source skips hidden files, yet `--out src/.t.u16` was refused as 'among what --source reads'."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n")
    for out in (src / ".t.u16", src / ".cache" / "t.u16"):
        out.parent.mkdir(exist_ok=True)
        sources.prepare_data(str(src), BYTES, out)
        again = sources.prepare_data(str(src), BYTES, out)  # the first run's files are not read as text
        assert again.tokens == len("hello world\n") and out.stat().st_size == 2 * again.tokens
    with pytest.raises(ConfigError, match="is among what --source .* reads"):
        sources.prepare_data(str(src), BYTES, src / "sub" / "t.u16")
