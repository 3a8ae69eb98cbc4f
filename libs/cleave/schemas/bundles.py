"""A model bundle: the files of a base model or a tokenizer as the PS serves them to the workers.

A bundle's manifest is named by the SHA-256 of its own bytes (the bundle id) and lists every file with its
SHA-256, so a bundle id names exactly one set of files and a worker can check what it fetched against the id
alone (`cleave.models.bundles`). A worker asks the PS for them part by part (`ModelsGet` on
`SUBJECT_MODELS_GET`, answered by a `ModelsPart` on the worker's own inbox).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cleave.schemas.base import Wire
from cleave.schemas.limits import MAX_MODELS_PART_BYTES

MAX_BUNDLE_FILES = 256  # a sharded checkpoint's files, its index, config and tokenizer files
MAX_OBJECT_BYTES = 1 << 44  # a file of a bundle (16 TiB)
SHA256_HEX = r"^[0-9a-f]{64}$"
MAX_MODELS_RETRY_S = 60.0  # the longest a request over its worker's budget is told to wait


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


class ModelsGet(Wire):
    """A worker asks for `length` bytes from `offset` of one object: a bundle's manifest (`kind` "bundle",
    `sha256` the bundle id) or a file (`kind` "file", `sha256` the file's). One that `waits` is told when to ask
    again past its worker's budget at the PS; an older worker would take that answer for a part, so past the
    budget its requests go unanswered."""

    kind: Literal["bundle", "file"]
    sha256: str = Field(pattern=SHA256_HEX)
    offset: int = Field(0, ge=0, le=MAX_OBJECT_BYTES)
    length: int = Field(gt=0, le=MAX_MODELS_PART_BYTES)
    waits: bool = False  # its sender waits `retry_after_s` and asks again when told


class ModelsPart(Wire):
    """The PS's answer: the object's `size` and its bytes from `offset` (at most what was asked, and what fits
    one message), or why it cannot send them (`error`), or, with no bytes, when to ask again (`retry_after_s`:
    the worker has drawn its budget of the PS's bytes)."""

    sha256: str = Field(pattern=SHA256_HEX)
    offset: int = Field(ge=0, le=MAX_OBJECT_BYTES)
    size: int = Field(ge=0, le=MAX_OBJECT_BYTES)
    data: bytes = Field(b"", max_length=MAX_MODELS_PART_BYTES)
    error: str = Field("", max_length=500)
    retry_after_s: float = Field(0.0, ge=0, le=MAX_MODELS_RETRY_S, allow_inf_nan=False)
