"""L0: file helpers shared by the data cache and the checkpoints (standard library only)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def staged_directory(out: str | Path, tmp_infix: str) -> Iterator[Path]:
    """A new directory ``<out><tmp_infix><random>`` beside ``out`` (its parents created as needed) for the block to
    fill.  When the block ends normally it becomes ``out`` in one rename (an empty ``out`` is replaced; one with
    anything in it fails the rename instead of being lost).  When the block raises, the temporary directory and the
    parents created for it are removed: a failed writer leaves the filesystem as it found it."""
    out = Path(out)
    created = first_missing_ancestor(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}{tmp_infix}", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # only an empty directory: anything in it raises here and stays
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
