"""An exclusive advisory lock on a file (``fcntl.flock``): processes wait on it without any process group.

The lock belongs to the open file, so it is released when the holder exits, even by a crash or a kill.  On a network
filesystem without lock support every process gets the lock at once; callers stay correct then because every file
they write is written under a name of its own and renamed into place.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, blocking: bool = True, on_wait=None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing).  ``blocking=False`` raises BlockingIOError when another
    process holds it; ``on_wait()`` is called once before waiting."""
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
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
