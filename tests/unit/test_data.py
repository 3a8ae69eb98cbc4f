"""Data sources, tokenisation and batches: every source kind, pinned batches, token files, clear errors."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from cleave.errors import ConfigError
from cleave.models.tokenizer import ByteTokenizer, load_tokenizer
from cleave.train import sources
from cleave.train.data import DEFAULT_MIN_TOKENS, Corpus
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_cli import data_cmd

BYTES = ByteTokenizer()
WORDS = (
    "edge",
    "devices",
    "train",
    "tiles",
    "of",
    "a",
    "transformer",
    "over",
    "slow",
    "links",
    "and",
    "come",
    "go",
)
# sha256 of the builtin text on the CPython the pins below were taken on (3.11.7)
BUILTIN_SHA = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
# (seed, step, batch_size, seq, split) -> sha256 of x.tobytes() + y.tobytes() (int64), taken from the code
# before multi-source data existed: the builtin corpus and the byte tokenizer must keep giving these batches
PINNED_BUILTIN = {
    (0, 0, 8, 64, "train"): "5feb6266e71df2bdc71a79bd3dbcb883232876da897821cc0090bb1d52b41d7e",
    (3, 0, 4, 128, "val"): "18d626c9ee7ade304d9c56b40dd53872eade2025e01256ed80674594d20b763b",
    (0, 1_000_000, 8, 64, "val"): "d5a75a8bce5e7d5934af913658b8085ea8a7e7309fc4e32e789fbc3256d09287",
}
PINNED_FILE = {
    (0, 0, 4, 32, "train"): "fffc6dc6f199d6c5b909dd22b9086efa2ac741a431370e3c4159a5b3a761cd7f",
    (2, 7, 4, 32, "val"): "8e5be3beae15be7c203e1d2c35f22e4ec0ad72b05202db8b4553ee23fb4f319c",
}


def digest(x: torch.Tensor, y: torch.Tensor) -> str:
    assert x.dtype == y.dtype == torch.int64
    return hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


def sample_bytes() -> bytes:
    """CRLF lines, non-ASCII, and invalid UTF-8 at the end (read as U+FFFD)."""
    lines = [f"line {i}: the quick brown fox ümlaut — {i * 7919 % 1000}\r\n" for i in range(400)]
    return "".join(lines).encode("utf-8") + b"\xff\xfe broken tail\n"


def words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n)) + "\n"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-style byte-level BPE with an end-of-text token and a vocabulary over the presets' 256."""
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([words(200, s) for s in range(20)], trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    assert 300 < tok.get_vocab_size() <= 400
    return d


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    p = tmp_path / "sample.txt"
    p.write_bytes(sample_bytes())
    return p


# ---------------------------------------------------------------- the default source, pinned


def test_builtin_bytes_batches_are_unchanged() -> None:
    if hashlib.sha256(sources.builtin_text().encode()).hexdigest() != BUILTIN_SHA:
        pytest.skip("this CPython ships different documentation text than the pins were taken on")
    corpus = Corpus()
    assert (len(corpus.train), len(corpus.val)) == (419645, 46628)
    for args, want in PINNED_BUILTIN.items():
        assert digest(*corpus.batch(*args)) == want, args


def test_text_file_batches_are_unchanged(text_file: Path) -> None:
    corpus = Corpus(str(text_file))
    for args, want in PINNED_FILE.items():
        assert digest(*corpus.batch(*args)) == want, args


def test_batches_depend_only_on_seed_and_step() -> None:
    a, b = Corpus(), Corpus()
    later = a.batch(0, 9, 4, 32)
    for step in range(10):
        x, y = b.batch(0, step, 4, 32)
        assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
    assert all(torch.equal(u, v) for u, v in zip(later, b.batch(0, 9, 4, 32), strict=True))
    assert not torch.equal(a.batch(0, 1, 4, 32)[0], a.batch(0, 2, 4, 32)[0])
    assert not torch.equal(a.batch(0, 1, 4, 32)[0], a.batch(1, 1, 4, 32)[0])


# ---------------------------------------------------------------- text sources


def test_text_is_read_in_pieces_without_changing_the_tokens(text_file: Path, bpe_dir: Path) -> None:
    whole = sources.tokenize(str(text_file), BYTES)
    assert bytes(whole.astype(np.uint8)) == text_file.read_text(encoding="utf-8", errors="replace").encode()
    assert np.array_equal(sources.tokenize(str(text_file), BYTES, chunk_chars=7), whole)
    pieces = list(next(sources.iter_documents(str(text_file), chunk_chars=100)))
    assert len(pieces) > 10 and all(p.endswith("\n") for p in pieces)


def test_folder_and_glob_read_files_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / ".git").mkdir()
    files = {"b/2.txt": words(900, 2), "a.md": words(900, 1), "b/1.txt": words(900, 3)}
    for name, text in files.items():
        (root / name).write_text(text)
    (root / ".git" / "HEAD").write_text("not training data")
    (root / ".hidden.txt").write_text("nor this")
    want = "\n\n".join(files[k] for k in ("a.md", "b/1.txt", "b/2.txt")).encode()
    assert bytes(sources.tokenize(str(root), BYTES).astype(np.uint8)) == want
    globbed = "\n\n".join(files[k] for k in ("b/1.txt", "b/2.txt")).encode()
    assert bytes(sources.tokenize(f"{root}/**/*.txt", BYTES).astype(np.uint8)) == globbed
    assert len(Corpus(str(root)).train) == int(len(want) * 0.9)


def test_jsonl_reads_a_text_field(tmp_path: Path, bpe_dir: Path) -> None:
    rows = [{"text": words(900, i), "body": f"row {i}", "n": i} for i in range(8)]
    p = tmp_path / "d.jsonl"
    p.write_text(
        "\n".join(json.dumps(r) for r in rows[:4]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[4:])
    )
    assert (
        bytes(sources.tokenize(str(p), BYTES).astype(np.uint8))
        == "\n\n".join(r["text"] for r in rows).encode()
    )
    assert bytes(sources.tokenize(f"{p}:body", BYTES).astype(np.uint8)) == b"\n\n".join(
        r["body"].encode() for r in rows
    )
    tok = load_tokenizer(bpe_dir)
    ids = sources.tokenize(str(p), tok)
    assert (ids == tok.eos_id).sum() == len(rows) - 1  # documents are separated by the end-of-text token
    assert Corpus(str(p), tokenizer=str(bpe_dir)).vocab_size == tok.vocab_size > 256


def test_jsonl_errors_name_the_line_and_field(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n{"content": "b"}\n')
    with pytest.raises(ConfigError, match=r"line 2 has no text field 'text' \(it has: content\).*:FIELD"):
        sources.tokenize(str(p), BYTES)
    p.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"line 2 is not JSON \(Expecting value at column 1\)"):
        sources.tokenize(str(p), BYTES)
    p.write_text('{"text": 123}\n')  # (it said: no text field 'text' (it has: text))
    with pytest.raises(ConfigError, match="line 1's 'text' is int, not text"):
        sources.tokenize(str(p), BYTES)
    p.write_text('{"prompt": "Q", "response": 5}\n')  # not instruction data (a response that is no string)
    with pytest.raises(ConfigError, match=r"need 'prompt' and 'response' to be strings \('response' is int\)"):
        sources.tokenize(str(p), BYTES)
    with pytest.raises(ConfigError, match="line 1 has no text field 'body'"):
        sources.tokenize(f"{p}:body", BYTES)


def test_missing_and_short_sources_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data='.*nope.txt': cannot read .*nope.txt"):
        Corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="cannot read"):
        Corpus(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="no files match"):
        Corpus(str(tmp_path / "*.txt"))
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ConfigError, match=f"has 9 tokens; need at least {DEFAULT_MIN_TOKENS}"):
        Corpus(str(tmp_path / "short.txt"))
    with pytest.raises(ConfigError, match="unknown options: splt"):
        Corpus("hf:wikitext?splt=train")


# ---------------------------------------------------------------- Hugging Face datasets


def test_hf_datasets_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # the source sets them: restore them afterwards
        monkeypatch.setenv(var, "1")
    with pytest.raises(ConfigError, match="need the `datasets` package"):
        Corpus("hf:some/dataset")


def test_hf_datasets_from_disk_and_local_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # read when datasets is first imported
    datasets = pytest.importorskip("datasets")
    rows = {"text": [words(200, i) for i in range(6)], "id": list(range(6))}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "saved"))
    want = "\n\n".join(rows["text"]).encode()
    got = sources.tokenize(f"hf:{tmp_path / 'saved'}", BYTES)
    assert bytes(got.astype(np.uint8)) == want
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in rows["text"]))
    got = sources.tokenize(f"hf:{files}?split=train&field=body", BYTES)
    assert bytes(got.astype(np.uint8)) == want
    with pytest.raises(ConfigError, match=r"no text field 'text' \(it has: body\)"):
        sources.tokenize(f"hf:{files}", BYTES)
    with pytest.raises(ConfigError, match="no split 'test'"):
        sources.tokenize(f"hf:{tmp_path / 'saved'}?split=test", BYTES)
    with pytest.raises(ConfigError, match="offline"):
        sources.tokenize("hf:cleave-tests/surely-not-cached", BYTES)


# ---------------------------------------------------------------- token files


def test_prepared_tokens_give_the_same_batches_as_the_text(
    tmp_path: Path, text_file: Path, bpe_dir: Path
) -> None:
    for tokenizer, suffix in (("bytes", ".u16"), (str(bpe_dir), ".u32"), (str(bpe_dir), ".bin")):
        out = tmp_path / f"t{suffix}"
        stats = sources.prepare_data(str(text_file), load_tokenizer(tokenizer), out, chunk_chars=500)
        meta = json.loads((tmp_path / f"t{suffix}.json").read_text())
        assert meta["tokens"] == stats.tokens == out.stat().st_size // np.dtype(meta["dtype"]).itemsize
        assert meta["tokenizer"] == tokenizer and stats.documents == 1 and stats.chars > 0
        text = Corpus(str(text_file), tokenizer=tokenizer)
        tokens = Corpus(str(out), tokenizer=tokenizer)
        assert isinstance(tokens.train, np.memmap) and tokens.vocab_size == text.vocab_size
        for step in range(3):
            for split in ("train", "val"):
                a, b = text.batch(1, step, 4, 16, split), tokens.batch(1, step, 4, 16, split)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_token_file_errors(tmp_path: Path, bpe_dir: Path) -> None:
    ids = np.arange(DEFAULT_MIN_TOKENS + 100, dtype=np.uint16) % 300
    (tmp_path / "raw.u16").write_bytes(ids.tobytes())
    with pytest.raises(ConfigError, match="token id 299, outside the tokenizer's vocabulary of 256"):
        Corpus(str(tmp_path / "raw.u16"))
    assert Corpus(str(tmp_path / "raw.u16"), tokenizer=str(bpe_dir)).vocab_size > 300
    (tmp_path / "raw.bin").write_bytes(ids.tobytes())
    with pytest.raises(
        ConfigError, match=r"unknown token dtype; name the file .u16 or .u32, or write raw.bin.json"
    ):
        Corpus(str(tmp_path / "raw.bin"))
    (tmp_path / "raw.bin.json").write_text('{"dtype": "uint16", "tokenizer": "bytes", "vocab_size": 512}')
    with pytest.raises(ConfigError, match=r"tokenised with 'bytes'; set tokenizer='bytes'"):
        Corpus(str(tmp_path / "raw.bin"), tokenizer=str(bpe_dir))
    assert Corpus(str(tmp_path / "raw.bin")).vocab_size == 512
    (tmp_path / "odd.u32").write_bytes(b"\x00" * 4099)
    with pytest.raises(ConfigError, match="not a whole number of uint32 tokens"):
        Corpus(str(tmp_path / "odd.u32"))
    with pytest.raises(ConfigError, match="no such token file"):
        Corpus(str(tmp_path / "absent.u16"))
    with pytest.raises(ConfigError, match="name it .u16, .u32 or .bin"):
        sources.prepare_data("builtin", BYTES, tmp_path / "out.npy")


def test_prepare_data_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    data_cmd.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "builtin.u16"
    args = parser.parse_args(["prepare-data", "--source", "builtin", "--out", str(out)])
    assert data_cmd.run(args) == 0
    printed = capsys.readouterr()
    assert "M tokens/s" in printed.err and f"to {out}" in printed.out
    assert json.loads((tmp_path / "builtin.u16.json").read_text())["documents"] > 1
    a, b = Corpus("builtin"), Corpus(str(out))
    assert torch.equal(a.batch(0, 3, 8, 64)[0], b.batch(0, 3, 8, 64)[0])


def test_prepare_data_refuses_what_would_go_wrong_later_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    """Its own output inside the source (a second run read the first's token file and sidecar as text: 14 ->
    216 tokens), an empty source (a 0-token file, refused only when a stack started), a file whose sidecar
    says more tokens than it holds (an incomplete copy trained on half the data), a full disk (a traceback)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n")
    (tmp_path / "t.u16.json").write_text("a text file named like the sidecar of t.u16\n")
    for source, out in ((str(src), src / "out.u16"), (f"{src}/*", src / "x.u16"),
                        (str(tmp_path / "t.u16.json"), tmp_path / "t.u16")):
        with pytest.raises(ConfigError, match="is among what --source .* reads"):
            sources.prepare_data(source, BYTES, out)
    assert sorted(p.name for p in src.iterdir()) == ["a.txt"]
    sources.prepare_data(f"{src}/*.txt", BYTES, src / "ok.u16")  # a glob that cannot match it: fine
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        sources.prepare_data(str(tmp_path / "empty"), BYTES, tmp_path / "e.u16")
    assert not list(tmp_path.glob("e.u16*"))
    full = sources.prepare_data("builtin", BYTES, tmp_path / "full.u16")
    half = full.tokens // 2
    (tmp_path / "half.u16").write_bytes((tmp_path / "full.u16").read_bytes()[: 2 * half])  # an incomplete copy
    (tmp_path / "half.u16.json").write_text((tmp_path / "full.u16.json").read_text())
    with pytest.raises(ConfigError, match=f"holds {half:,} tokens but half.u16.json says {full.tokens}"):
        Corpus(str(tmp_path / "half.u16"))
    if Path("/dev/full").exists():  # a device whose writes fail with ENOSPC
        (tmp_path / "disk").mkdir()
        (tmp_path / "disk" / "d.u16.tmp").symlink_to("/dev/full")
        with pytest.raises(ConfigError, match="not written: .*No space left on device"):
            sources.prepare_data("builtin", BYTES, tmp_path / "disk" / "d.u16")
        assert not (tmp_path / "disk" / "d.u16").exists() and not (tmp_path / "disk" / "d.u16.json").exists()


def test_a_token_files_tokenizer_is_recorded_by_absolute_path(tmp_path: Path, bpe_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded as typed ('bpe'), the same tokenizer was refused from another working directory, and another
    tokenizer that a folder there held under the same name was taken for it."""
    shutil.copytree(bpe_dir, tmp_path / "here" / "bpe")
    (tmp_path / "elsewhere" / "bpe").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    sources.prepare_data("builtin", load_tokenizer("bpe"), tmp_path / "t.u16")
    assert json.loads((tmp_path / "t.u16.json").read_text())["tokenizer"] == str(tmp_path / "here" / "bpe")
    monkeypatch.chdir(tmp_path)
    assert Corpus(str(tmp_path / "t.u16"), tokenizer="here/bpe").vocab_size > 256  # the same, named otherwise
    monkeypatch.chdir(tmp_path / "elsewhere")  # where 'bpe' is another folder
    with pytest.raises(ConfigError, match="was tokenised with"):
        Corpus(str(tmp_path / "t.u16"), tokenizer="bpe")


# ---------------------------------------------------------------- with the trainer


def test_vocab_too_small_for_the_tokenizer_names_both(bpe_dir: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"tokenizer '.*' has 3\d\d tokens but preset 'tiny' has vocab_size=256"
    ):
        Trainer(JobConfig(preset="tiny", tokenizer=str(bpe_dir)))


@pytest.mark.parametrize("kind", ["jsonl", "tokens"])
def test_val_loss_with_other_sources(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": words(400, i)}) + "\n" for i in range(8)))
    data = str(p)
    if kind == "tokens":
        data = str(tmp_path / "d.u16")
        sources.prepare_data(str(p), BYTES, data)
    trainer = Trainer(JobConfig(preset="tiny", data=data, batch_size=4, seq_len=32, val_every=1))
    first = trainer.step(0)
    val = trainer.val_loss(0)
    assert np.isfinite(val) and abs(val - first) < 1.0


def test_a_token_files_sidecar_is_checked_before_anything_starts(tmp_path: Path, bpe_dir: Path) -> None:
    """A file made with another tokenizer (or one whose vocabulary the model has no room for) was found only by
    the PS, 8 s into a started stack, after a dry run had said `fits`; and a tokenizer named by its folder and
    by its tokenizer.json counted as two."""
    from cleave.train.data import check_token_file  # noqa: PLC0415

    sources.prepare_data("builtin", load_tokenizer(str(bpe_dir / "tokenizer.json")), tmp_path / "t.u16")
    src = sources.parse_source(str(tmp_path / "t.u16"))
    vocab = load_tokenizer(str(bpe_dir)).vocab_size
    check_token_file(src, str(bpe_dir), 512, "small")  # the folder of the file it was made with: the same
    assert Corpus(str(tmp_path / "t.u16"), tokenizer=str(bpe_dir)).vocab_size == vocab
    with pytest.raises(ConfigError, match=r"was tokenised with .*tokenizer\.json'; set tokenizer="):
        check_token_file(src, "bytes", 512, "small")
    with pytest.raises(ConfigError, match=f"has {vocab} tokens but preset 'tiny' has vocab_size=256"):
        check_token_file(src, str(bpe_dir), 256, "tiny")


def test_prepare_data_that_cannot_put_its_file_in_place_leaves_the_earlier_sidecar(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """`--out` an existing folder: the run failed at its last rename, after writing a sidecar that described a
    token file never written (over the earlier one), and the error named the .tmp as the folder."""
    (tmp_path / "dir.u16").mkdir()
    with pytest.raises(ConfigError, match=r"--out .*dir\.u16 is a folder: name the token file to write"):
        sources.prepare_data("builtin", BYTES, tmp_path / "dir.u16")
    assert not (tmp_path / "dir.u16.json").exists()
    sources.prepare_data("builtin", BYTES, tmp_path / "t.u16")
    earlier = (tmp_path / "t.u16.json").read_text()

    replace = Path.replace

    def refuse(self, target):  # noqa: ANN001, ANN202 - the token file's rename fails (a disk gone read-only)
        if Path(target).name != "t.u16":
            return replace(self, target)
        raise OSError(errno.EROFS, "Read-only file system", str(self), None, str(target))

    monkeypatch.setattr(Path, "replace", refuse)
    with pytest.raises(ConfigError, match=r"t\.u16 not written: .*t\.u16: Read-only file system"):
        sources.prepare_data("builtin", BYTES, tmp_path / "t.u16", chunk_chars=1 << 16)
    assert (tmp_path / "t.u16.json").read_text() == earlier


def test_an_empty_data_spec_is_refused() -> None:
    """`--source ''` tokenised the whole working directory (an empty path is '.')."""
    with pytest.raises(ConfigError, match="the data spec is empty"):
        sources.parse_source("")
    with pytest.raises(ConfigError, match="the data spec is empty"):
        sources.prepare_data(" ", BYTES, Path("never.u16"))
    assert not Path("never.u16").exists()
