"""A model bundle: the files of a base model or a tokenizer as the PS publishes them to the workers.

Stored in the Object Store `MODELS_OBJECTS`: each file once under its content (`file.<sha256>`), and the
bundle's manifest under the SHA-256 of its own bytes (`bundle.<id>`), so a bundle id names exactly one set of
files and a worker can check what it fetched against the id alone (`cleave.models.bundles`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cleave.schemas.base import Wire

MAX_BUNDLE_FILES = 256  # a sharded checkpoint's files, its index, config and tokenizer files
SHA256_HEX = r"^[0-9a-f]{64}$"


class BundleFile(Wire):
    """One file: its name in the bundle's directory, its size, its SHA-256 and that of every chunk."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")  # a plain file name: no folders, nothing hidden
    size: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_HEX)
    chunk_bytes: int = Field(gt=0)
    chunk_sha256: tuple[str, ...] = Field(max_length=1 << 20)


class Bundle(Wire):
    kind: Literal["model", "tokenizer"]
    files: tuple[BundleFile, ...] = Field(min_length=1, max_length=MAX_BUNDLE_FILES)
