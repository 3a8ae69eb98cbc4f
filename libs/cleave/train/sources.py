"""Where training text comes from, and turning it into token ids in bounded pieces.

A data spec (the job's `data`) is one of:

    builtin                  Python's own documentation text (ships with CPython)
    path/to/file.txt         a UTF-8 text file (any suffix not listed below)
    path/to/folder           every non-hidden file under it, sorted by relative path
    path/**/*.md             a glob, sorted (`**` descends into folders)
    path/to/data.jsonl       JSON lines, field "text"; `data.jsonl:body` reads field "body"
    hf:NAME_OR_DIR?name=CONFIG&split=train&field=text
                             a Hugging Face dataset: a `save_to_disk` folder, a folder of data files, or a
                             dataset already in the local cache (never downloaded); needs `datasets`
    path/to/tokens.u16       pre-tokenised ids, raw little-endian uint16 (`.u32`: uint32; `.bin`: dtype from
                             the sidecar `tokens.bin.json`), read through a memory map

Text is yielded in documents (a file, a JSONL line, a dataset row) of pieces of at most 2 x DEFAULT_CHUNK_CHARS
characters (`reading.file_pieces` says where a file is cut), so that a corpus of any size is tokenised in bounded
memory and `cleave prepare-data` gives exactly the tokens that reading the text directly gives.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

import numpy as np

from cleave.errors import ConfigError
from cleave.models.tokenizer import ByteTokenizer, Tokenizer, recorded_spec
from cleave.runtime.files import write_atomic
from cleave.train import reading

BUILTIN = "builtin"
HF_PREFIX = "hf:"
DEFAULT_CHUNK_CHARS = 1 << 20  # text is tokenised in pieces of this many characters to twice as many
DEFAULT_JSONL_FIELD = "text"
DEFAULT_HF_SPLIT = "train"
DOC_SEPARATOR = "\n\n"  # between documents, for tokenizers without an end-of-text token
TOKEN_SUFFIXES = {".u16": "uint16", ".u32": "uint32"}
TOKEN_DTYPES = ("uint16", "uint32")
SIDECAR_SUFFIX = ".json"  # tokens.u16 -> tokens.u16.json: {"dtype", "tokenizer", "vocab_size", "tokens", ...}
TOKEN_FORMAT = "cleave-tokens"

Document = Iterator[str]  # the pieces of one document, in order


@dataclass(frozen=True)
class Source:
    """A parsed data spec."""

    spec: str
    kind: str  # builtin | text | folder | glob | jsonl | hf | tokens
    path: str = ""
    text_field: str = DEFAULT_JSONL_FIELD
    options: dict[str, str] = field(default_factory=dict)  # hf: name, split


def parse_source(spec: str) -> Source:
    """Classify a data spec; files are not opened yet (a missing one is reported when read)."""
    if not spec.strip():  # (an empty path is the working directory: it was read whole, as a folder)
        raise ConfigError("the data spec is empty: name a file, folder, glob, JSONL, hf:... or 'builtin'")
    if spec == BUILTIN:
        return Source(spec, "builtin")
    if spec.startswith(HF_PREFIX):
        path, _, query = spec[len(HF_PREFIX) :].partition("?")
        options = dict(parse_qsl(query, keep_blank_values=True))
        unknown = sorted(set(options) - {"name", "split", "field"})
        if not path or unknown:
            raise ConfigError(
                f"data={spec!r}: expected hf:NAME_OR_DIR?name=..&split=..&field=.. "
                f"(unknown options: {', '.join(unknown) or 'none'})"
            )
        return Source(spec, "hf", path, options.pop("field", DEFAULT_JSONL_FIELD), options)
    head, sep, tail = spec.rpartition(":")
    if sep and head.endswith(".jsonl") and tail:
        return Source(spec, "jsonl", head, tail)
    suffix = Path(spec).suffix
    if suffix == ".jsonl":
        return Source(spec, "jsonl", spec)
    if suffix in TOKEN_SUFFIXES or suffix == ".bin":
        return Source(spec, "tokens", spec)
    if any(c in spec for c in "*?["):
        return Source(spec, "glob", spec)
    if Path(spec).expanduser().is_dir():
        return Source(spec, "folder", spec)
    return Source(spec, "text", spec)


def recorded_source(spec: str) -> str:
    """`spec` with its local path made absolute (as `recorded_spec` does a tokenizer's), so that a job read
    from another working directory names the same files; builtin, hub names and paths not here as they are."""
    try:
        src = parse_source(spec)
    except ConfigError:  # (reported where the spec is read)
        return spec
    if src.kind == "builtin":
        return spec
    path = Path(src.path).expanduser()
    if src.kind == "glob":
        absolute = os.path.abspath(path)
    elif path.exists():
        absolute = str(path.resolve())
    else:
        return spec
    prefix = HF_PREFIX if src.kind == "hf" else ""
    return prefix + absolute + spec[len(prefix) + len(src.path):]


# ---------------------------------------------------------------- text


def builtin_text() -> str:
    """Python's own documentation topics: ships with every CPython, so the demo needs no download."""
    from pydoc_data.topics import topics

    return DOC_SEPARATOR.join(topics[k] for k in sorted(topics))


def _builtin_documents() -> Iterator[Document]:
    from pydoc_data.topics import topics

    for k in sorted(topics):
        yield iter((topics[k],))


def _files(src: Source) -> list[Path]:
    files = reading.glob_files(src.path) if src.kind == "glob" else reading.folder_files(Path(src.path).expanduser())
    if not files:
        raise ConfigError(f"data={src.spec!r}: no files match")
    return files


def _jsonl_documents(src: Source) -> Iterator[Document]:
    with reading.open_text(Path(src.path).expanduser(), src.spec) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data={src.spec!r}: line {lineno} is not JSON ({e.msg} at column "
                                  f"{e.colno})") from None
            text = row.get(src.text_field) if isinstance(row, dict) else None
            if isinstance(row, dict) and src.text_field in row and not isinstance(text, str):
                raise ConfigError(f"data={src.spec!r}: line {lineno}'s {src.text_field!r} is "
                                  f"{type(text).__name__}, not text")
            if not isinstance(text, str):
                fields = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
                hint = (isinstance(row, dict) and _instruction_hint(row)) or f"name the field as {src.path}:FIELD"
                raise ConfigError(f"data={src.spec!r}: line {lineno} has no text field {src.text_field!r} "
                                  f"(it has: {fields}); {hint}")
            yield iter((text,))


def _instruction_hint(row: dict) -> str | None:
    """What to do with a JSONL row of instruction data (`cleave.train.examples`) where text was expected: its
    kind is told by its fields, as the kind of a source is (chat rows first); None for any other row."""
    where = "which trains from the JSONL file itself (--data FILE, with no :FIELD) and cannot be prepared"
    if "messages" in row:
        if isinstance(row["messages"], list):
            return f"chat rows ('messages') are instruction data, {where}"
        return f"chat rows need 'messages' to be a list of turns, not {type(row['messages']).__name__}"
    if "prompt" in row or "response" in row:
        bad = [f"{k!r} is {type(row[k]).__name__}" if k in row else f"{k!r} is missing"
               for k in ("prompt", "response") if not isinstance(row.get(k), str)]
        if not bad:
            return f"prompt/response rows are instruction data, {where}"
        return f"prompt/response rows need 'prompt' and 'response' to be strings ({', '.join(bad)})"
    return None


def _hf_dataset(src: Source):  # noqa: ANN202 - datasets is optional
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # never download: only local folders and the local cache
    os.environ["HF_HUB_OFFLINE"] = "1"
    check_source(src)
    import datasets

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # if imported before us
    split = src.options.get("split") or DEFAULT_HF_SPLIT
    path = Path(src.path).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(src.path, src.options.get("name") or None, split=split)
    except Exception as e:  # datasets raises many kinds; all mean "not available offline"
        raise ConfigError(
            f"data={src.spec!r}: cannot load it from disk or the local cache, offline ({e})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"data={src.spec!r}: no split {split!r} (it has: {', '.join(ds)})")
        ds = ds[split]
    if src.text_field not in ds.column_names:
        raise ConfigError(
            f"data={src.spec!r}: no text field {src.text_field!r} (it has: {', '.join(ds.column_names)}); "
            "choose one with &field="
        )
    return ds


def _hf_documents(src: Source) -> Iterator[Document]:
    ds = _hf_dataset(src)
    for batch in ds.select_columns([src.text_field]).iter(batch_size=1000):
        for text in batch[src.text_field]:
            yield iter((text or "",))


def iter_documents(source: str | Source, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[Document]:
    """The documents of a text source, in a fixed order; each one a sequence of pieces."""
    src = source if isinstance(source, Source) else parse_source(source)
    if src.kind == "builtin":
        yield from _builtin_documents()
    elif src.kind == "text":
        yield reading.file_pieces(Path(src.path).expanduser(), src.spec, chunk_chars)
    elif src.kind in ("folder", "glob"):
        for path in _files(src):
            yield reading.file_pieces(path, src.spec, chunk_chars)
    elif src.kind == "jsonl":
        yield from _jsonl_documents(src)
    elif src.kind == "hf":
        yield from _hf_documents(src)
    else:
        raise ConfigError(f"data={src.spec!r} holds token ids, not text")


def check_source(source: str | Source) -> int | None:
    """What can be told of a data source without reading it whole: it is there and readable (a token file: its
    dtype, sidecar and length; a Hugging Face dataset: the `datasets` package is installed). Returns its bytes on
    disk (`source_bytes`) where it is text, None for token files and datasets."""
    src = source if isinstance(source, Source) else parse_source(source)
    if src.kind == "hf" and importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"data={src.spec!r}: Hugging Face datasets need the `datasets` package "
                          "(pip install datasets); or export the text to JSONL")
    if src.kind == "tokens":
        open_tokens(src)
        return None
    return None if src.kind == "hf" else source_bytes(src.spec)


def source_bytes(spec: str) -> int:
    """How big a data source is on disk (the builtin text: its UTF-8 bytes; a dataset: its rows), checking that
    it is there and readable: what a worker declares about its own data, and nothing else."""
    src = parse_source(spec)
    if src.kind == "builtin":
        return len(builtin_text().encode("utf-8"))
    if src.kind == "hf":
        return len(_hf_dataset(src))
    files = _files(src) if src.kind in ("folder", "glob") else [Path(src.path).expanduser()]
    total, binary = 0, []
    for f in files:
        try:
            with reading.open_text(f, spec, errors="replace") as fh:  # (there, readable and a regular file; its
                # bytes not counted as the reading's undecodable ones)
                fh.read(1)
            total += f.stat().st_size
            binary += [f] if src.kind in ("text", "folder", "glob") and reading.looks_binary(f) else []
        except OSError as e:
            raise ConfigError(f"data={spec!r}: cannot read {f} ({e.strerror})") from None
    if len(binary) == len(files):  # (read as text, they would train the model on noise)
        what = f"none of its {len(files)} files is text ({files[0].name}" if len(files) > 1 else "it is no text (it"
        raise ConfigError(f"data={spec!r}: {what} looks binary: a PDF, an image, an archive?); convert the "
                          "documents to UTF-8 text first (.txt files, or JSONL)")
    return total


# ---------------------------------------------------------------- tokens


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode(tok: Tokenizer, text: str, dtype: np.dtype) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):  # the common case, without a Python list per byte
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    return np.asarray(tok.encode(text), dtype=dtype)


def iter_token_chunks(
    source: str | Source, tok: Tokenizer, chunk_chars: int = DEFAULT_CHUNK_CHARS
) -> Iterator[tuple[np.ndarray, int, int]]:
    """Token ids of a text source in order, as (ids, characters read, document number); documents are
    separated by the tokenizer's end-of-text token, or by a blank line when it has none. Files that are no text
    (`check_source`) are refused before any is read: the PS and `cleave data prepare` trained on their noise."""
    check_source(source)
    dtype = token_dtype(tok.vocab_size)
    sep = np.array([tok.eos_id], dtype) if tok.eos_id is not None else encode(tok, DOC_SEPARATOR, dtype)
    for i, doc in enumerate(iter_documents(source, chunk_chars)):
        if i:
            yield sep, 0, i
        for piece in doc:
            yield encode(tok, piece, dtype), len(piece), i


def tokenize(source: str | Source, tok: Tokenizer, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> np.ndarray:
    """All token ids of a text source, in memory (use `prepare_data` for corpora larger than RAM)."""
    parts = [ids for ids, _, _ in iter_token_chunks(source, tok, chunk_chars)]
    return np.concatenate(parts) if parts else np.zeros(0, token_dtype(tok.vocab_size))


@dataclass(frozen=True)
class TokenFile:
    """A memory-mapped file of token ids and what its sidecar says about them."""

    tokens: np.ndarray
    tokenizer: str | None  # the spec that produced them, when recorded
    vocab_size: int | None


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def open_tokens(source: str | Source) -> TokenFile:
    src = source if isinstance(source, Source) else parse_source(source)
    path = Path(src.path).expanduser()
    meta: dict = {}
    side = sidecar_path(path)
    if side.is_file():
        try:
            meta = json.loads(side.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"data={src.spec!r}: cannot read its sidecar {side} ({e})") from None
    dtype = TOKEN_SUFFIXES.get(path.suffix) or meta.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(
            f"data={src.spec!r}: unknown token dtype; name the file .u16 or .u32, or write "
            f'{side.name} with {{"dtype": "uint16"}} (or "uint32")'
        )
    if meta.get("dtype", dtype) != dtype:
        raise ConfigError(f"data={src.spec!r}: the suffix says {dtype} but {side.name} says {meta['dtype']}")
    if not path.is_file():
        raise ConfigError(f"data={src.spec!r}: no such token file {path}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise ConfigError(f"data={src.spec!r}: {size} bytes is not a whole number of {dtype} tokens")
    tokens = (
        np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r") if size else np.zeros(0, dtype)
    )
    if "tokens" in meta and meta["tokens"] != len(tokens):
        raise ConfigError(f"data={src.spec!r} holds {len(tokens):,} tokens but {side.name} says {meta['tokens']}: "
                          "an incomplete copy, or a file another run overwrote; copy it again or prepare it again")
    vocab = meta.get("vocab_size")
    return TokenFile(tokens, meta.get("tokenizer"), int(vocab) if vocab is not None else None)


# ---------------------------------------------------------------- prepare-data


@dataclass
class PrepareStats:
    documents: int = 0
    chars: int = 0
    tokens: int = 0
    undecodable: int = 0  # bytes that were not UTF-8, read as U+FFFD: binary files, or another encoding


def prepare_data(
    source: str,
    tok: Tokenizer,
    out: str | Path,
    on_progress: Callable[[PrepareStats], None] | None = None,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
) -> PrepareStats:
    """Tokenise a text source into a token file and its sidecar, streaming; returns the counts.

    The file is written under a temporary name and renamed when complete, so a reader never sees half of it.
    """
    out = Path(out)
    dtype = TOKEN_SUFFIXES.get(out.suffix) or (
        str(token_dtype(tok.vocab_size)) if out.suffix == ".bin" else None
    )
    if dtype is None:
        raise ConfigError(f"--out {out}: name it .u16, .u32 or .bin (the suffix gives the token dtype)")
    if tok.vocab_size > np.iinfo(dtype).max + 1:
        raise ConfigError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} tokens, too many for {dtype}; use .u32"
        )
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: name the token file to write (e.g. {out / 'corpus.u16'})")
    stats = PrepareStats()
    tmp, side = out.with_name(out.name + ".tmp"), sidecar_path(out)
    before = side.read_bytes() if side.is_file() else None  # an earlier run's sidecar, put back if this one fails
    if _reads(parse_source(source), (out, tmp, side)):
        raise ConfigError(f"--out {out} is among what --source {source!r} reads: a later run would tokenise it (and "
                          "its sidecar) as text; write it outside the source")
    undecodable = reading.undecodable_bytes()
    try:
        with open(tmp, "wb") as f:
            for ids, chars, doc in iter_token_chunks(source, tok, chunk_chars):
                f.write(ids.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes())
                stats.documents, stats.chars, stats.tokens = doc + 1, stats.chars + chars, stats.tokens + len(ids)
                stats.undecodable = reading.undecodable_bytes() - undecodable
                if on_progress and chars:
                    on_progress(stats)
        if not stats.tokens:
            raise ConfigError(f"--source {source!r} holds no text: nothing to train on")
        meta = {
            "format": TOKEN_FORMAT,
            "dtype": dtype,
            "tokens": stats.tokens,
            "tokenizer": recorded_spec(tok.name),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "source": source,
            "documents": stats.documents,
            "undecodable_bytes": stats.undecodable,
        }
        # the sidecar first: a crash between the two renames leaves an earlier token file whose count the new
        # sidecar contradicts (`open_tokens` refuses it), never new tokens described by an older sidecar
        try:
            write_atomic(side, json.dumps(meta, indent=2) + "\n")
            tmp.replace(out)
        except BaseException:  # a failed rename, Ctrl-C: the new sidecar would describe tokens that are not there
            if tmp.exists() and before is None:  # (no .tmp: the token file is in place, the sidecar its own)
                side.unlink(missing_ok=True)
            elif tmp.exists():
                write_atomic(side, before)
            raise
    except OSError as e:  # a full disk, a folder that is not there or not writable
        where = e.filename2 or e.filename or out  # (a rename's failure is its destination's)
        raise ConfigError(f"prepare-data stopped, {out} not written: {where}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)  # (nothing half-written is left behind: a failure, Ctrl-C)
    return stats


def _reads(src: Source, paths: tuple[Path, ...]) -> bool:
    """Whether text source `src` would read any of `paths` (written by prepare-data: out, its .tmp, sidecar)."""
    if src.kind == "text":
        return any(p.resolve() == Path(src.path).expanduser().resolve() for p in paths)
    if src.kind == "folder":  # (a hidden file in it is not read)
        root = Path(src.path).expanduser().resolve()
        return any(p.resolve().is_relative_to(root) and not reading.hidden(p.resolve(), root) for p in paths)
    if src.kind == "glob":
        pattern = os.path.expanduser(src.path)
        return any(fnmatch.fnmatch(str(p), pattern) or fnmatch.fnmatch(os.path.abspath(p), os.path.abspath(pattern))
                   for p in paths)
    return False
