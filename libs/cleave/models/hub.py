"""The local Hugging Face cache: a repo id's snapshot, found without touching the network."""

from __future__ import annotations

import re
from pathlib import Path

_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def cached_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `repo_id`, or None; never touches the network."""
    if not _REPO_ID.fullmatch(repo_id):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or not a valid repo id: the caller reports what it looked for
        return None
