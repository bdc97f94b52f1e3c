"""One training per directory: the launch's rank 0 holds ``train.lock`` in the checkpoint directory (and in an
explicit run directory) for the run's whole life, so a second training given the same ``--save`` is refused before
it creates a process group or writes a file.  Without it both runs save the same ``step<N>`` tags and the last writer
wins each one, while both report "saved checkpoint".

The lock is ``data/lock.file_lock``'s (the one ``prepare`` takes): the kernel releases it when its holder exits, so a
lock left by a crashed or killed run is taken over by the next one.  Only rank 0 takes it; the other ranks of a
refused launch are stopped by DeepSpeed's launcher when rank 0 exits with an error.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack
from pathlib import Path

from ds_megatron.config import ConfigError, RunConfig
from ds_megatron.data.lock import file_lock, lock_owner

LOCK = "train.lock"


def locked_dirs(run: RunConfig) -> list[tuple[str, Path]]:
    """(setting, directory) of every directory this run writes that another run could name too: the checkpoint
    directory and an explicit run directory (a run directory derived from ``--save``, or a new one per run, is
    covered by the first or is its own)."""
    sec = run.section
    named = [("ds_megatron.checkpoint.save", sec.checkpoint.save), ("ds_megatron.logging.run_dir", sec.logging.run_dir)]
    dirs: list[tuple[str, Path]] = []
    for setting, value in named:
        if value and all(Path(value).resolve() != d.resolve() for _, d in dirs):
            dirs.append((setting, Path(value)))
    return dirs


def owner_record() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"


def hold_run_lock(run: RunConfig, holder: bool) -> ExitStack:
    """Take this run's locks (``holder``: this process is the launch's rank 0; the others take none) and return
    them as one context to hold for the run's life; ConfigError naming the other run's process when one holds any."""
    stack = ExitStack()
    if not holder:
        return stack
    for setting, directory in locked_dirs(run):
        path = directory / LOCK
        try:
            stack.enter_context(file_lock(path, blocking=False, owner=owner_record()))
        except BlockingIOError:
            stack.close()
            flag = "--save" if setting.endswith(".save") else f"--set {setting}=DIR"
            raise ConfigError(
                setting,
                "another training is writing this directory",
                f"{path} is held by {lock_owner(path) or 'a process that has not written its id yet'}",
                f"wait for that run to end (or stop it), or pass another directory ({flag})",
            ) from None
    return stack
