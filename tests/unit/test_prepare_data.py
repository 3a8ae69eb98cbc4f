"""`cleave prepare-data` as a user meets it: what it refuses and why, what it reads, what it prints."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTok

from cleave.errors import ConfigError
from cleave.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from cleave.train import sources
from cleave_cli import data_cmd

BYTES = ByteTokenizer()
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # the three ways BPE tokenizers in use split text into words before merging
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "llama3": lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "sentencepiece": lambda: pre_tokenizers.Metaspace(),
}


def long_lines_text(seed: int = 0) -> str:
    """Lines from a few characters to many pieces long: runs of spaces, tabs, digits, punctuation, non-ASCII,
    CRLF, and one long line with no space at all."""
    rng = np.random.default_rng(seed)
    vocab = ["the", "edge", "1234567", "  ", "\t", "naïve", "—", "x.y", "(a,b)", "'s", "don't", "\u3000", "日本語"]
    lines = []
    for n in rng.integers(0, 400, 60):
        lines.append(" ".join(rng.choice(vocab, n)) + ("\r\n" if n % 3 else "\n"))
    return "".join(lines) + "z" * 700 + "\nlast line without a newline"


def readline_pieces(path: Path, chunk_chars: int) -> Iterator[str]:
    """How a file was read before a piece was bounded: `chunk_chars` characters, then the rest of the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while piece := f.read(chunk_chars):
            yield piece if piece.endswith("\n") else piece + f.readline()


def prepare(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    data_cmd.register(parser.add_subparsers(dest="command"))
    return data_cmd.run(parser.parse_args(["prepare-data", *argv]))


def ids(tok: Tokenizer, pieces: Iterator[str]) -> list[int]:
    return [i for p in pieces for i in tok.encode(p)]


@pytest.fixture(scope="module", params=sorted(PRE_TOKENIZERS))
def bpe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = PRE_TOKENIZERS[request.param]()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([long_lines_text(s) for s in range(1, 4)], trainer)
    d = tmp_path_factory.mktemp(request.param)
    tok.save(str(d / "tokenizer.json"))
    return load_tokenizer(d)


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


@pytest.mark.parametrize("chunk_chars", [16, 64, 1000])
def test_long_lines_are_read_in_bounded_pieces_with_the_same_tokens(tmp_path: Path, bpe: Tokenizer,
                                                                    chunk_chars: int) -> None:
    """A piece was `chunk_chars` characters and then the rest of its line: a file of one long line (minified
    JSON) was read whole. A line that runs on more than `chunk_chars` further is now cut before a space, which
    gives the ids the whole line gave; only a run of `chunk_chars` characters with no space is cut where the ids
    may change (for byte tokens they never do)."""
    p = tmp_path / "long.txt"
    p.write_text(long_lines_text(), encoding="utf-8", newline="")
    pieces = list(next(sources.iter_documents(str(p), chunk_chars)))
    assert max(map(len, pieces)) <= 2 * chunk_chars and "".join(pieces) == "".join(readline_pieces(p, 1 << 30))
    assert np.array_equal(sources.tokenize(str(p), BYTES, chunk_chars), ids(BYTES, readline_pieces(p, chunk_chars)))
    if chunk_chars < 700 // 2:  # the line of 700 'z's, cut at 2 x chunk_chars: the one place ids may differ
        p.write_text(long_lines_text().replace("z" * 700, "z " * 350), encoding="utf-8", newline="")
    assert list(sources.tokenize(str(p), bpe, chunk_chars)) == ids(bpe, readline_pieces(p, chunk_chars))


def test_a_file_with_no_long_line_is_cut_where_it_was(tmp_path: Path) -> None:
    p = tmp_path / "short.txt"
    p.write_text("".join(f"line {i}: " + "w " * (i % 50) + "\n" for i in range(2000)))
    assert list(next(sources.iter_documents(str(p), 100))) == list(readline_pieces(p, 100))


def test_bytes_that_are_not_utf8_are_counted_and_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder with binary files in it (images, .pyc) was tokenised as U+FFFD without a word."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("plain text\n")
    bad = b"\xff\xfe" + b"x\xe2\x82y" + "ü".encode() + b"\xc3"  # 2 bytes, a cut euro sign (2), a cut ü (1)
    (src / "b.pyc").write_bytes(bad)
    assert bad.decode("utf-8", errors="replace").count("\ufffd") == 4
    assert prepare("--source", str(src), "--out", str(tmp_path / "t.u16")) == 0
    assert "5 bytes not UTF-8 (read as U+FFFD: binary files?)" in capsys.readouterr().err
    assert json.loads((tmp_path / "t.u16.json").read_text())["undecodable_bytes"] == 5
    assert np.array_equal(np.fromfile(tmp_path / "t.u16", np.uint16),  # read as errors="replace" reads them
                          np.frombuffer(("plain text\n\n\n" + bad.decode(errors="replace")).encode(), np.uint8))
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'{"text": "a\xff"}\n')
    assert sources.prepare_data(str(jsonl), BYTES, tmp_path / "j.u16").undecodable == 1
    assert sources.prepare_data(str(src / "a.txt"), BYTES, tmp_path / "a.u16").undecodable == 0
    assert prepare("--source", str(src / "a.txt"), "--out", str(tmp_path / "a.u16")) == 0
    assert "UTF-8" not in capsys.readouterr().err


def test_ctrl_c_says_that_nothing_was_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C exited 130 and removed the .tmp, without a word."""
    (tmp_path / "a.txt").write_text("other text\n")
    out = tmp_path / "out" / "t.u16"
    out.parent.mkdir()

    def ctrl_c(*_: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(data_cmd.ProgressLine, "update", ctrl_c)  # (called while the .tmp is half written)
        assert prepare("--source", "builtin", "--out", str(out)) == 130
    assert capsys.readouterr().err.endswith(f"cleave: prepare-data interrupted: nothing written, no {out} made\n")
    assert not list(out.parent.iterdir())
    assert prepare("--source", "builtin", "--out", str(out)) == 0
    earlier = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    capsys.readouterr()
    write_atomic = sources.write_atomic

    def sidecar_then_ctrl_c(path: Path, data: str) -> None:  # Ctrl-C between the sidecar and the token file
        write_atomic(path, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(sources, "write_atomic", sidecar_then_ctrl_c)
    assert prepare("--source", str(tmp_path / "a.txt"), "--out", str(out)) == 130
    assert capsys.readouterr().err.endswith(f"interrupted: nothing written, {out} is as it was\n")
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == earlier


def test_a_message_after_a_status_line_on_a_terminal_starts_a_line_of_its_own() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    line = data_cmd.ProgressLine(Terminal(), every_s=0)
    line.said("first")
    line.update(sources.PrepareStats(1, 10, 10))
    line.said("second")
    assert line.stream.getvalue().startswith("first\n\r1 documents") and line.stream.getvalue().endswith("\nsecond\n")


@pytest.mark.timeout(30)
def test_a_device_or_a_pipe_is_refused_as_data_before_it_is_read(tmp_path: Path) -> None:
    """data=/dev/zero was read for ever (a hub's PS grew 65 MB/s), and opening a pipe waits for a writer: both
    are refused by name, as text, JSONL or a worker's declared data, before anything is read."""
    import os  # noqa: PLC0415

    from cleave.train.sources import check_source, iter_documents, source_bytes  # noqa: PLC0415

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for spec in ("/dev/zero", str(fifo), f"{fifo}:text"):
        with pytest.raises(ConfigError, match="is not a regular file"):
            [list(doc) for doc in iter_documents(spec)]
        with pytest.raises(ConfigError, match="is not a regular file"):
            source_bytes(spec)
    with pytest.raises(ConfigError, match="is not a regular file"):
        check_source("/dev/zero")


def test_data_that_holds_no_text_is_refused_before_a_stack_starts(tmp_path: Path, capsys) -> None:
    """`cleave train --data papers/`, a folder of PDFs, trained on their bytes read as U+FFFD without a word (the
    dry run said `fits`). A source none of whose files is text is refused, status 2; one binary file among
    text files is still read as the docs say (its bad bytes as U+FFFD)."""
    import zlib  # noqa: PLC0415

    from cleave.train.sources import source_bytes  # noqa: PLC0415
    from cleave_cli.main import main  # noqa: PLC0415

    papers = tmp_path / "papers"
    papers.mkdir()
    stream = zlib.compress(bytes(range(256)) * 64)  # a PDF's compressed stream: binary, NULs and all
    for name in ("a.pdf", "b.pdf"):
        (papers / name).write_bytes(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\nstream\n" + stream + b"\nendstream\n")
    for spec, says in ((papers, "none of its 2 files is text (a.pdf looks binary"),
                       (papers / "b.pdf", "it is no text (it looks binary")):
        assert main(["train", "--preset", "tiny", "--data", str(spec), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert says in err and "convert the documents to UTF-8 text first" in err and len(err.splitlines()) == 1
    (papers / "notes.txt").write_text("some words to train on\n" * 10)
    assert source_bytes(str(papers)) == sum(f.stat().st_size for f in papers.iterdir())
    (tmp_path / "t.u16").write_bytes(bytes(range(256)))  # a worker's own token file is binary by nature
    assert source_bytes(str(tmp_path / "t.u16")) == 256


def test_a_ps_or_cleave_data_given_no_text_refuses_it(tmp_path: Path) -> None:
    """`cleave ps --job` (a PS started by hand) and `cleave data prepare` read a PDF as text and trained on (or
    wrote) its noise: every reader of a text source checks it first."""
    from cleave.errors import ConfigError  # noqa: PLC0415
    from cleave.models.tokenizer import ByteTokenizer  # noqa: PLC0415
    from cleave.train.data import Corpus  # noqa: PLC0415
    from cleave.train.sources import prepare_data  # noqa: PLC0415

    pdf = tmp_path / "scan.pdf"
    pdf.write_bytes(b"%PDF-1.4\n" + bytes(range(256)) * 64)
    with pytest.raises(ConfigError, match="it is no text"):
        Corpus(str(pdf), 0.1, "bytes", "random")
    with pytest.raises(ConfigError, match="it is no text"):
        prepare_data(str(pdf), ByteTokenizer(), tmp_path / "out.u16")
    assert not (tmp_path / "out.u16").exists()
