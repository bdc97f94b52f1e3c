"""L0.5: file helpers shared by the data cache and the checkpoints (standard library only)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary name, then rename: readers see the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def first_missing_ancestor(path: str | Path) -> Path | None:
    """The outermost directory of ``path`` (itself included) that does not exist yet: what to remove, after a
    failure, to leave the filesystem as it was before ``path`` was created with its parents.  None if it exists."""
    path, missing = Path(path), None
    while not path.exists():
        missing, path = path, path.parent
    return missing
