"""Text files as training text: which files a folder or glob names, and a file's text in bounded pieces.

A folder is read whole except its hidden files and folders (a name that starts with "."); `hidden` is that
rule, for whoever must know what a folder source reads. A byte that is not UTF-8 is read as U+FFFD and counted
(`undecodable_bytes`), so that binary files among the text are noticed.
"""

from __future__ import annotations

import codecs
import glob
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from cleave.errors import ConfigError

SPACE_AFTER_WORD = re.compile(r"(?<=\S) ")  # where a long line may be cut (Python's \s: every Unicode space)
REPLACE_COUNTING = "cleave-replace-counting"  # errors= for reading text: "replace", counting the bytes replaced

SNIFF_BYTES = 8192  # of a data file read to tell whether it is text (`looks_binary`)

_replaced = threading.local()  # .n: bytes this thread has read as U+FFFD


def _replace_counting(e: UnicodeError) -> tuple[str, int]:
    """As errors="replace" decodes (one U+FFFD for each invalid sequence); called only for invalid bytes, so
    valid text costs nothing more."""
    if not isinstance(e, UnicodeDecodeError):
        raise e
    _replaced.n = getattr(_replaced, "n", 0) + e.end - e.start
    return "\ufffd", e.end


codecs.register_error(REPLACE_COUNTING, _replace_counting)


def undecodable_bytes() -> int:
    """How many bytes that are not UTF-8 this thread has read as U+FFFD so far, through REPLACE_COUNTING: the
    difference around a reading is that reading's count."""
    return getattr(_replaced, "n", 0)


def looks_binary(path: Path) -> bool:
    """Whether a readable file looks like no text at all: a NUL byte in its first SNIFF_BYTES, as git and grep
    tell binary files, or more than a third of them not UTF-8 (a PDF, an image, an archive, a `.pyc`)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    return b"\0" in head or head.decode("utf-8", errors="replace").count("\ufffd") * 3 > len(head)


def hidden(path: Path, root: Path) -> bool:
    """Whether `path`, under folder `root`, is hidden from a folder source: it or a folder above it (below
    `root`) has a name that starts with "."."""
    return any(s.startswith(".") for s in path.relative_to(root).parts)


def folder_files(root: Path) -> list[Path]:
    """The files under `root` that a folder source reads, sorted by relative path."""
    return sorted(
        (p for p in root.rglob("*") if p.is_file() and not hidden(p, root)),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def glob_files(pattern: str) -> list[Path]:
    """The files a glob matches, sorted (`**` descends into folders)."""
    return sorted(p for p in map(Path, glob.glob(os.path.expanduser(pattern), recursive=True)) if p.is_file())


def check_regular(path: Path, setting: str) -> None:
    """ConfigError naming `setting` (`data='...'`) where `path` is there but no regular file: a device
    (/dev/zero) never ends, and opening a pipe waits for a writer, perhaps for ever. Nothing is opened."""
    if path.exists() and not path.is_file():
        raise ConfigError(f"{setting}: {path} is not a regular file (a device, pipe or socket): name a file")


def open_text(path: Path, spec: str, errors: str = REPLACE_COUNTING) -> TextIO:
    """`path` open to read as UTF-8 text; ConfigError naming data `spec` where it cannot be, or where it is no
    regular file (`check_regular`)."""
    check_regular(path, f"data={spec!r}")
    try:
        return open(path, encoding="utf-8", errors=errors)  # noqa: SIM115 - the caller closes it
    except OSError as e:
        raise ConfigError(f"data={spec!r}: cannot read {path} ({e.strerror})") from None


def file_pieces(path: Path, spec: str, chunk_chars: int) -> Iterator[str]:
    """A text file in pieces of `chunk_chars` characters and the rest of the line they end in, as long as that
    rest is at most `chunk_chars` more; a longer line is cut where `cut` says and read on to its end by the
    next pieces. So no piece holds more than 2 x `chunk_chars` characters, a file of one long line included.
    Universal newlines; a byte that is not UTF-8 is read as U+FFFD and counted."""
    with open_text(path, spec) as f:
        ahead, in_line = "", False  # what was read past the last cut; whether that cut was inside a line
        while piece := ahead + f.read(chunk_chars - len(ahead)):
            end = piece.find("\n", 0 if in_line else len(piece) - 1) + 1  # (0: none)
            if not end:
                start = len(piece)
                piece += f.read(chunk_chars)
                end = cut(piece, start)
            piece, ahead, in_line = piece[:end], piece[end:], piece[end - 1] != "\n"
            yield piece


def cut(text: str, start: int) -> int:
    """Where a piece that holds `text[:start]` (and no newline it needs to end at) ends: after the first newline
    from `start` on; else before the first space from there that follows a non-space character; else at the
    end of `text`.

    A tokenizer that splits its words before a space (GPT-2's and Llama 3's pre-tokenizers, SentencePiece's
    "▁") gives the ids for the two sides of such a space that it gives for them together; only a cut at the end
    of `text`, in a run with no such space, may split a word that reading the line whole would not.
    """
    newline = text.find("\n", start)
    if newline >= 0:
        return newline + 1
    space = SPACE_AFTER_WORD.search(text, start)
    return space.start() if space else len(text)
