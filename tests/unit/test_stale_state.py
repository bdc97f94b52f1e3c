"""What a killed run leaves behind is cleared at the start of a test session (``launch.clear_stale_state``, called
by ``tests/conftest.py``), and nothing a live process holds: a lock file its builder keeps open, a buffer mapped by
a running job, or anything younger than a minute."""

from __future__ import annotations

import mmap
import os
import time

from launch import clear_stale_state


def test_only_old_files_nothing_holds_are_removed(tmp_path):
    names = ["dead/lock", "open/lock", "mapped/lock", "young/lock", "other/file"]
    paths = {name: tmp_path / name for name in names}
    for path in paths.values():
        path.parent.mkdir()
        path.write_bytes(b"x" * 4096)
    old = time.time() - 120
    for name in names[:3] + names[4:]:
        os.utime(paths[name], (old, old))
    fd = os.open(paths["open/lock"], os.O_RDWR)  # a builder holding its lock
    with open(paths["mapped/lock"], "r+b") as f:  # a job's buffer, mapped
        buffer = mmap.mmap(f.fileno(), 4096)
    try:
        removed = clear_stale_state([(tmp_path, "*/lock")])
    finally:
        buffer.close()
        os.close(fd)
    assert removed == [paths["dead/lock"]]
    assert [name for name in names if paths[name].exists()] == names[1:]
