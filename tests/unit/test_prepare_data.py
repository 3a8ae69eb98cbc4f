"""`cleave prepare-data` as a user meets it: what it refuses and why, what it reads, what it prints."""

from __future__ import annotations

import json
from pathlib import Path

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


@pytest.mark.parametrize(("row", "said"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, r"chat rows \('messages'\) are instruction data, which"),
    ({"prompt": "Q", "response": "A"}, "prompt/response rows are instruction data, which"),
    ({"messages": "hi"}, "chat rows need 'messages' to be a list of turns, not str"),
    ({"prompt": "Q"}, r"prompt/response rows need 'prompt' and 'response' to be strings \('response' is missing\)"),
])
def test_instruction_rows_are_refused_with_what_fits_their_kind(tmp_path: Path, row: dict, said: str) -> None:
    """Chat rows were told that "'prompt' and 'response' must both be strings"."""
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=f"line 1 has no text field 'text' .*; {said}") as e:
        sources.prepare_data(str(p), BYTES, tmp_path / "t.u16")
    assert ("prompt" in str(e.value).partition("(it has")[2]) == ("prompt" in row)
    assert not list(tmp_path.glob("t.u16*"))
