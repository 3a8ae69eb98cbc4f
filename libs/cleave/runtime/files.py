"""Whole-file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644) -> Path:
    """Write `data` to `path` through a temporary beside it and a rename; `mode` holds from the first byte.

    A secret written with mode 0o600 is never world-readable, not even briefly; a failure (a full disk, a folder
    that is not writable) leaves the old file as it was and no temporary behind.
    """
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.chmod(tmp, mode)  # the umask may have narrowed it
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
