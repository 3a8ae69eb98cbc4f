"""Text files as training text: which files a folder or glob names, and a file's text in bounded pieces.

A folder is read whole except its hidden files and folders (a name that starts with "."); `hidden` is that
rule, for whoever must know what a folder source reads.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path

from cleave.errors import ConfigError


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


def file_pieces(path: Path, spec: str, chunk_chars: int) -> Iterator[str]:
    """A text file in pieces cut after a newline; universal newlines and U+FFFD for bad bytes."""
    try:
        f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by the generator
    except OSError as e:
        raise ConfigError(f"data={spec!r}: cannot read {path} ({e.strerror})") from None
    with f:
        while piece := f.read(chunk_chars):
            if not piece.endswith("\n"):
                piece += f.readline()
            yield piece
