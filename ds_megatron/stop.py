"""A graceful stop: SIGTERM or SIGINT to a worker, or the end of the launcher processes above it, asks the training to
finish the current step, save and exit 0.

Why the launchers are watched: a signal sent to the ``deepspeed`` command a user typed (their ``kill``, a batch
scheduler's time limit) reaches only DeepSpeed's runner.  On a single node (and on every node of a ``--no_ssh``
launch) that runner installs no handler: it dies at once and passes nothing on, leaving its per-node launcher
(``deepspeed.launcher.launch``) and the workers training with no parent and no checkpoint at the end.  So each worker
remembers, at start, its launcher and the process that started the launcher; when either goes away (the launcher is
re-parented, or this worker is), that is a stop request like a signal.  A signal that does reach the launcher is
forwarded by it to the workers (it kills them 30 s later); a terminal's Ctrl-C reaches every process of the group.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import torch
import torch.distributed as dist

LAUNCHER_MODULE = "deepspeed.launcher.launch"
POLL_SECONDS = 1.0


class StopFlag:
    """Set by SIGTERM / SIGINT or by the launcher watch; :meth:`agreed` makes every rank stop together."""

    def __init__(self, watch_launcher: bool = True):
        self.requested = False
        self.reason = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        chain = launcher_chain() if watch_launcher else None
        if chain is not None:
            threading.Thread(target=self._watch, args=chain, name="ds_megatron-launcher-watch", daemon=True).start()

    def _handle(self, signum, frame):
        self.request(f"received {signal.Signals(signum).name}")

    def request(self, reason: str) -> None:
        if not self.requested:
            self.reason = reason
        self.requested = True

    def _watch(self, launcher_pid: int, starter_pid: int) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            why = chain_broken(launcher_pid, starter_pid)
            if why:
                self.request(why)
                return

    def agreed(self, device) -> bool:
        """Collective: stop when any rank was asked to."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def launcher_chain() -> tuple[int, int] | None:
    """(launcher pid, pid of the process that started the launcher) when this process is a worker of DeepSpeed's
    per-node launcher, else None (a plain ``python`` run, another launcher: nothing to watch)."""
    try:
        launcher = psutil.Process(os.getppid())
        if LAUNCHER_MODULE not in " ".join(launcher.cmdline()):
            return None
        return launcher.pid, launcher.ppid()
    except psutil.Error:
        return None


def chain_broken(launcher_pid: int, starter_pid: int) -> str | None:
    """Why the launcher chain recorded at start no longer holds, or None while it does."""
    if os.getppid() != launcher_pid:
        return f"the deepspeed launcher (pid {launcher_pid}) exited"
    try:
        if psutil.Process(launcher_pid).ppid() != starter_pid:
            return f"the deepspeed command (pid {starter_pid}) exited"
    except psutil.Error:
        return f"the deepspeed launcher (pid {launcher_pid}) exited"
    return None
