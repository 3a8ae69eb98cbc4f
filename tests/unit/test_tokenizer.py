"""Tokenizers: the byte-level default, and BPE tokenizers trained locally, saved, and loaded back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from cleave.errors import ConfigError
from cleave.models.tokenizer import TOKENIZER_RECORD, ByteTokenizer, Tokenizer, load_tokenizer

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Edge devices have little memory and slow, asymmetric links; they come and go.",
    "Sub-GEMM tiles: the inner dimension is never split, so a returned block is final.",
    "Grüße aus Köln, naïve café, 東京 and emoji 🙂 travel as bytes.",
] * 20
SAMPLE = "The lazy fox sends tiles to the edge. Grüße 🙂"


def _gpt2_style() -> HFTok:
    """Byte-level BPE as GPT-2 and Llama 3 use it, with GPT-2's end-of-text token."""
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def _llama2_style() -> HFTok:
    """SentencePiece-like BPE (Metaspace, byte fallback) with <s> and </s>, as Llama 2's tokenizer.json."""
    tok = HFTok(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>", *bytes_], show_progress=False
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id, tok.bos_id) == ("bytes", 256, None, None)
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == SAMPLE
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut multi-byte character decodes, it does not raise


def test_byte_tokenizer_rejects_ids_outside_a_byte() -> None:
    with pytest.raises(ValueError, match="outside 0..255"):
        ByteTokenizer().decode([65, 300])


def test_bpe_from_tokenizer_json_round_trips(tmp_path: Path) -> None:
    trained = _gpt2_style()
    trained.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, Tokenizer)
    assert tok.name == str(tmp_path)
    assert tok.vocab_size == trained.get_vocab_size() == 400
    assert tok.eos_id == trained.token_to_id("<|endoftext|>")
    assert tok.bos_id == tok.eos_id  # GPT-2 has no bos of its own: Hugging Face's config names its eos there
    ids = tok.encode(SAMPLE)
    assert ids == trained.encode(SAMPLE).ids
    assert len(ids) < len(SAMPLE.encode("utf-8"))  # the merges were learnt and are used
    assert tok.decode(ids) == SAMPLE
    assert load_tokenizer(tmp_path / "tokenizer.json").encode(SAMPLE) == ids  # the file itself works too
    # a special token's string in text is text (a quoted "<|endoftext|>" forged a document boundary), unless
    # the text is a chat template's rendering
    quoted = "ab<|endoftext|>cd"
    assert tok.eos_id not in tok.encode(quoted) and tok.decode(tok.encode(quoted)) == quoted
    assert tok.eos_id in tok.encode(quoted, special=True)


def test_gpt2_vocab_and_merges_files(tmp_path: Path) -> None:
    trained = _gpt2_style()
    trained.model.save(str(tmp_path))  # GPT-2's original format: vocab.json + merges.txt
    assert {p.name for p in tmp_path.iterdir()} == {"vocab.json", "merges.txt"}
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode(SAMPLE) == trained.encode(SAMPLE).ids
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_llama_style_tokenizer_json(tmp_path: Path) -> None:
    trained = _llama2_style()
    trained.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (trained.token_to_id("<s>"), trained.token_to_id("</s>"))
    ids = tok.encode(SAMPLE)
    assert ids == trained.encode(SAMPLE).ids
    assert tok.decode(ids) == SAMPLE


def test_record_of_an_exported_byte_checkpoint(tmp_path: Path) -> None:
    (tmp_path / TOKENIZER_RECORD).write_text(json.dumps({"tokenizer": "bytes"}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    (tmp_path / TOKENIZER_RECORD).write_text(json.dumps({"tokenizer": "/gone/gpt2"}))
    with pytest.raises(ConfigError, match="names tokenizer '/gone/gpt2' but its files are not"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({}, "no tokenizer files in .*tokenizer.json, or vocab.json and merges.txt"),
        ({"vocab.json": "{}"}, "no tokenizer files"),  # merges.txt missing
        ({"tokenizer.model": "x"}, "sentencepiece tokenizer.model"),
        ({"tokenizer.json": "{not json"}, "cannot read tokenizer file"),
    ],
)
def test_missing_or_broken_files_are_named(tmp_path: Path, files: dict[str, str], match: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_tokenizer(tmp_path)


def test_unknown_spec_is_not_downloaded(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a local path, and not in the local Hugging Face cache"):
        load_tokenizer(str(tmp_path / "absent"))
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ConfigError, match="not a tokenizer.json"):
        load_tokenizer(tmp_path / "vocab.txt")
