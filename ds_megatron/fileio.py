"""L0.5: file helpers shared by the data cache and the checkpoints (standard library only)."""

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


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back: the only portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``mkdir``/``open`` would have (0o777 / 0o666 less the
    umask).  ``tempfile.mkdtemp`` makes its directory 0700 and safetensors writes its files 0600 whatever the umask,
    so without this a model written for a teammate or a serving account could be read by its owner only."""
    mask = current_umask()
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def staged_directory(out: str | Path, tmp_infix: str) -> Iterator[Path]:
    """A new directory ``<out><tmp_infix><random>`` beside ``out`` (its parents created as needed) for the block to
    fill.  When the block ends normally it becomes ``out`` in one rename (an empty ``out`` is replaced; one with
    anything in it fails the rename instead of being lost).  When the block raises, the temporary directory and the
    parents created for it are removed: a failed writer leaves the filesystem as it found it.  What it holds gets the
    modes the umask gives (:func:`apply_umask`), as files written in place would."""
    out = Path(out)
    created = first_missing_ancestor(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}{tmp_infix}", dir=out.parent))
    try:
        yield tmp
        apply_umask(tmp)
        if out.exists():
            out.rmdir()  # only an empty directory: anything in it raises here and stays
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
