"""An exclusive advisory lock on a file (``fcntl.flock``): processes wait on it without any process group.

The lock belongs to the open file, so it is released when the holder exits, even by a crash or a kill: a lock file
left behind by a dead process is simply taken by the next one (the file stays; only a live holder blocks).  On a
network filesystem without lock support every process gets the lock at once; callers stay correct then because every
file they write is written under a name of its own and renamed into place.

A holder may write who it is into the lock file (``owner``), so that a process refused the lock can name it
(:func:`lock_owner`); the next holder overwrites the record.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, blocking: bool = True, on_wait=None, owner: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing).  ``blocking=False`` raises BlockingIOError when another
    process holds it; ``on_wait()`` is called once before waiting.  ``owner``: a line written into the file once the
    lock is held, replacing the previous holder's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                raise
            if on_wait is not None:
                on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        if owner is not None:
            fh.seek(0)
            fh.truncate()
            fh.write(owner + "\n")
            fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def lock_owner(path: Path) -> str | None:
    """The record the lock's holder wrote (``file_lock(owner=...)``), None when there is none yet."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None
